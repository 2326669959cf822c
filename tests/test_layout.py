"""The layout the code promises: no import cycle inside mtp_jax, counting imports
inside functions too (a local import only defers a cycle), no module over 400 lines, and no
module outside mtp_jax/heads/ naming a head kind. Read from the source with `ast`; nothing is
imported."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 400


def module_names(root: str, package: str) -> dict[str, str]:
  """Dotted module name -> file, for every .py file under root/package."""
  out = {}
  for dirpath, _, files in os.walk(os.path.join(root, package)):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
        if rel[-1] == "__init__":
          rel = rel[:-1]
        out[".".join(rel)] = os.path.join(dirpath, name)
  return out


def _runtime_nodes(tree: ast.AST):
  """Every node, except the bodies of `if TYPE_CHECKING:` blocks: imports that only type
  checkers read are never executed, so they cannot form an import cycle."""
  stack = [tree]
  while stack:
    node = stack.pop()
    yield node
    for child in ast.iter_child_nodes(node):
      if (isinstance(child, ast.If) and isinstance(child.test, ast.Name)
          and child.test.id == "TYPE_CHECKING"):
        stack.extend(child.orelse)
        continue
      stack.append(child)


def import_graph(root: str, package: str) -> dict[str, set[str]]:
  """module -> the package's modules it imports, anywhere in the file (module level, functions,
  `if __name__ == "__main__"`). `from pkg import name` counts pkg.name when that is a module."""
  modules = module_names(root, package)
  graph = {}
  for mod, path in modules.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    deps = set()
    for node in _runtime_nodes(tree):
      if isinstance(node, ast.Import):
        deps.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the module's own package, up level - 1
          parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
          parts = parts[:len(parts) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        for a in node.names:
          deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    graph[mod] = {d for d in deps if d in modules and d != mod}
  return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle (as a closed path a -> ... -> a) per strongly connected component with one."""
  index, low, on_stack, stack, sccs = {}, {}, set(), [], []

  def strongconnect(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        strongconnect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      scc = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        scc.append(w)
        if w == v:
          break
      if len(scc) > 1:
        sccs.append(set(scc))

  for v in sorted(graph):
    if v not in index:
      strongconnect(v)
  cycles = []
  for scc in sccs:  # a shortest path back to the start inside the component, breadth first
    start = min(scc)
    paths = {start: [start]}
    frontier = [start]
    while frontier and start not in [w for v in frontier for w in graph[v]]:
      nxt = []
      for v in frontier:
        for w in sorted(graph[v] & scc):
          if w not in paths:
            paths[w] = paths[v] + [w]
            nxt.append(w)
      frontier = nxt
    last = next(v for v in frontier if start in graph[v])
    cycles.append(paths[last] + [start])
  return cycles


def test_no_import_cycles():
  cycles = find_cycles(import_graph(ROOT, "mtp_jax"))
  assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_sees_function_local_and_relative_imports(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg import b\n")
  (pkg / "b.py").write_text("import os\n\ndef f():\n  from pkg.sub import c\n  return c\n")
  (pkg / "sub" / "c.py").write_text("from .. import a\n")
  (pkg / "d.py").write_text("from pkg.a import x\n")  # into the cycle, not part of it
  graph = import_graph(str(tmp_path), "pkg")
  assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
  assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
  (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                           "  from pkg.sub import c\n")  # read by type checkers only
  assert find_cycles(import_graph(str(tmp_path), "pkg")) == []


def test_no_file_over_400_lines():
  long = []
  for folder in ("mtp_jax", "experiments", "tests"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
      for name in sorted(files):
        if name.endswith(".py"):
          path = os.path.join(dirpath, name)
          with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
          if n > MAX_LINES:
            long.append(f"{os.path.relpath(path, ROOT)} ({n} lines)")
  assert not long, f"over {MAX_LINES} lines: " + ", ".join(long)


def kind_names(heads_dir: str) -> set[str]:
  """The names under which mtp_jax/heads/*.py register head kinds: `@register("name")`."""
  names = set()
  for name in os.listdir(heads_dir):
    if name.endswith(".py"):
      with open(os.path.join(heads_dir, name), encoding="utf-8") as f:
        for node in ast.walk(ast.parse(f.read())):
          if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "register"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
  return names


def kind_name_uses(root: str, package: str, kinds: set[str]) -> list[str]:
  """'path:line "name"' for every string constant equal to a kind's name in the package's
  modules outside its heads/ (a docstring or a longer string that mentions a kind is fine)."""
  found = []
  for path in sorted(module_names(root, package).values()):
    rel = os.path.relpath(path, root)
    if rel.split(os.sep)[:2] == [package, "heads"]:
      continue
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      if isinstance(node, ast.Constant) and node.value in kinds:
        found.append(f"{rel}:{node.lineno} {node.value!r}")
  return found


# The one default kind name (JAX-free, so config.py need not load the registry), and a sweep
# file's `parallel` (runs at once), which is no head kind.
KIND_NAME_ALLOWED = {"mtp_jax/model_args.py": 1, "mtp_jax/sweeps/sweep.py": 1}


def test_no_module_outside_heads_names_a_kind():
  kinds = kind_names(os.path.join(ROOT, "mtp_jax", "heads"))
  assert kinds == {"parallel", "projection", "sequential"}, kinds  # the finder sees them all
  uses = kind_name_uses(ROOT, "mtp_jax", kinds)
  per_file = {}
  for use in uses:
    per_file.setdefault(use.split(":")[0], []).append(use)
  wrong = [u for f, us in per_file.items() if len(us) > KIND_NAME_ALLOWED.get(f, 0) for u in us]
  assert not wrong, ("modules outside mtp_jax/heads/ name a head kind (ask the HeadKind "
                     "registry instead): " + ", ".join(wrong))


def test_kind_name_finder(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "heads").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "heads" / "__init__.py").write_text('KIND = "alpha"\n')  # inside heads/: fine
  (pkg / "a.py").write_text('"""alpha heads, documented."""\nX = f"{1} alpha"\n')
  assert kind_name_uses(str(tmp_path), "pkg", {"alpha"}) == []
  (pkg / "b.py").write_text('def f(k):\n  return k == "alpha"\n')
  assert kind_name_uses(str(tmp_path), "pkg", {"alpha"}) == [f"pkg{os.sep}b.py:2 'alpha'"]


def test_config_imports_no_jax():
  """Reading a config loads no JAX and nothing from mtp_jax but the JAX-free declarations of
  its sections (ModelArgs, the data and loss fields)."""
  import subprocess
  import sys
  code = ("import sys, mtp_jax.config; print(sorted(m for m in sys.modules "
          "if m == 'jax' or m.startswith('mtp_jax.')))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       check=True, env={**os.environ, "PYTHONPATH": ROOT}).stdout
  assert out.strip() == ("['mtp_jax.config', 'mtp_jax.config.base', 'mtp_jax.data', "
                         "'mtp_jax.data.fields', 'mtp_jax.loss_fields', 'mtp_jax.model_args']"), out


# The layer order, bottom first (docs/DESIGN.md "Layers"): a module imports only from its own
# layer or one below, function-local imports included. A module is in the layer of the longest
# name here that is it or a package above it; every module must be in one.
LAYERS = [
    ("declarations", ["mtp_jax", "mtp_jax.model_args", "mtp_jax.loss_fields", "mtp_jax.cli",
                      "mtp_jax.attention_mask", "mtp_jax.checkpoint", "mtp_jax.sharding",
                      "mtp_jax.hostinfo"]),
    ("backends", ["mtp_jax.backends"]),
    ("layers", ["mtp_jax.attention", "mtp_jax.layers"]),
    ("heads", ["mtp_jax.heads", "mtp_jax.flops"]),
    ("model", ["mtp_jax.model", "mtp_jax.loss", "mtp_jax.optimizer", "mtp_jax.steps",
               "mtp_jax.acceptance"]),
    ("data", ["mtp_jax.data"]),
    ("config", ["mtp_jax.config"]),  # one layer: validation asks the head and corpus registries
    ("runs", ["mtp_jax.workdir", "mtp_jax.metrics", "mtp_jax.aot", "mtp_jax.distributed"]),
    ("decoding", ["mtp_jax.decoding"]),
    ("tools", ["mtp_jax.train", "mtp_jax.generate", "mtp_jax.evaluate", "mtp_jax.evaluation",
               "mtp_jax.convert", "mtp_jax.sweeps"]),
]


def layer_of(module: str, layers) -> int | None:
  best = None
  for rank, (_, names) in enumerate(layers):
    for name in names:
      if (module == name or module.startswith(name + ".")) and (
          best is None or len(name) > len(best[1])):
        best = (rank, name)
  return None if best is None else best[0]


def layer_violations(graph: dict[str, set[str]], layers) -> list[str]:
  """'a (layer) -> b (higher layer)' for every import up the order, 'a: in no layer' for a
  module the list misses."""
  out = [f"{m}: in no layer" for m in sorted(graph) if layer_of(m, layers) is None]
  for m in sorted(graph):
    for d in sorted(graph[m]):
      lm, ld = layer_of(m, layers), layer_of(d, layers)
      if lm is not None and ld is not None and ld > lm:
        out.append(f"{m} ({layers[lm][0]}) -> {d} ({layers[ld][0]})")
  return out


def test_no_import_points_up_a_layer():
  wrong = layer_violations(import_graph(ROOT, "mtp_jax"), LAYERS)
  assert not wrong, "imports up the layer order: " + "; ".join(wrong)


def test_layer_check_sees_an_import_up(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "cfg").mkdir(parents=True)
  for name in ("__init__.py", "cfg/__init__.py", "cfg/checks.py", "model.py"):
    (pkg / name).write_text("")
  layers = [("low", ["pkg", "pkg.cfg"]), ("mid", ["pkg.model"]), ("high", ["pkg.cfg.checks"])]
  (pkg / "cfg" / "checks.py").write_text("from pkg import model\n")  # down: fine
  assert layer_violations(import_graph(str(tmp_path), "pkg"), layers) == []
  (pkg / "model.py").write_text("def f():\n  from pkg.cfg import checks\n")  # up, hidden
  assert layer_violations(import_graph(str(tmp_path), "pkg"), layers) == [
      "pkg.model (mid) -> pkg.cfg.checks (high)"]
  assert layer_violations(import_graph(str(tmp_path), "pkg"), layers[1:]) == [
      "pkg: in no layer", "pkg.cfg: in no layer",
      "pkg.model (mid) -> pkg.cfg.checks (high)"]
