"""Shared fixtures: tiny configs and models that compile in a second or two on a CPU."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys

# Tiny test programs spend their time compiling, not running. On jaxlib 0.10's CPU backend these
# two flags together cut the compile time of a small transformer's gradient ~7x (either alone
# barely helps); compiled code runs ~2.5x slower, which only matters to a test that trains for
# many steps. The maths is the same (memory_analysis differs by bytes). Appended, so flags the
# caller set (a simulated device count) are kept and a flag the caller names wins;
# MTP_JAX_TEST_FAST_COMPILE=0 turns this off.
_FAST_COMPILE = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0")
if os.environ.get("MTP_JAX_TEST_FAST_COMPILE", "1") != "0":
  _flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join(
      [_flags] + [f for f in _FAST_COMPILE if f.split("=")[0] not in _flags]).strip()

# One persistent XLA compilation cache for the whole run: pytest's own process makes the folder
# before it starts its workers, and they and every subprocess a test starts (train, sweep,
# resume, two processes) inherit it. Many tests compile the same tiny programs (a run and its
# resume, a sweep and the run it repeats); the second compile is a file read. A cached program
# is the compiled one, so results are unchanged; the folder goes at exit.
# MTP_JAX_TEST_COMPILE_CACHE=0 turns this off.
if (os.environ.get("MTP_JAX_TEST_COMPILE_CACHE", "1") != "0"
    and not os.environ.get("JAX_COMPILATION_CACHE_DIR")):
  import atexit
  import tempfile
  _cache = tempfile.mkdtemp(prefix="mtp_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# auto's timing cache (mtp_jax.decoding.timing_cache) off: a test decides from its own probes,
# never from what an earlier run or another test left in the user's ~/.cache (test_timing_cache
# sets a folder of its own).
os.environ.setdefault("MTP_JAX_CACHE", "off")

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mtp_jax import config as config_lib  # noqa: E402
from mtp_jax.model import build_model, init_params  # noqa: E402


# Folder -> the tier marker every test in it gets (pytest.ini registers them; --strict-markers).
_FOLDER_MARKS = {"integration": "integration", "tpu": "tpu_aot", "gpu": "gpu_aot",
                 "slurm": "slurm"}


# The files that take longest (--durations of `make test`, 2 cores: 100-170 s each) run first:
# pytest-xdist's loadfile hands out files in collection order, and one of them drawn last would
# leave the other worker idle while it runs.
_LONGEST_FIRST = ("test_train.py", "test_sampling.py", "integration/test_smollm2.py",
                  "test_sharding.py", "test_decode.py", "test_model.py")


def pytest_collection_modifyitems(config, items):
  tests = os.path.dirname(os.path.abspath(__file__))
  rank, order = {name: i for i, name in enumerate(_LONGEST_FIRST)}, {}
  for item in items:
    rel = os.path.relpath(str(item.path), tests).replace(os.sep, "/")
    if rel.split("/")[0] in _FOLDER_MARKS:
      item.add_marker(_FOLDER_MARKS[rel.split("/")[0]])
    order[item] = rank.get(rel, len(rank))
  items.sort(key=order.__getitem__)  # stable


def require(module_name: str):
  """The module, as pytest.importorskip: a test needing an optional extra (torch, transformers,
  nbclient) is skipped where it is not installed, except under CI (the CI environment variable
  set and not empty), where a missing extra fails the test instead of skipping it silently."""
  if os.environ.get("CI"):
    try:
      return importlib.import_module(module_name)
    except ImportError as e:
      pytest.fail(f"CI is set and {module_name} does not import ({e}); install the test extra "
                  "(pip install -e '.[test]')", pytrace=False)
  return pytest.importorskip(module_name)


def tiny_config(kind: str = "parallel", n_future: int = 2):
  """vocab 61, d_model 32, 4 layers, 4 attention heads (2 kv), d_ff 64, seq_len 16."""
  c = config_lib.base_config()
  m = c.model
  m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = 61, 32, 4, 4, 2
  m.d_ff, m.max_len = 64, 32
  m.n_future = n_future
  m.heads.kind = kind
  c.data.seq_len = 16
  c.train.batch_size = 2
  return c


def tree_model(kind: str):
  """(args, params) of a random 4-head model of `kind` (max_len 64), as the tree tests use it: a
  random model's heads rarely agree with head 1, and larger weights in the heads would not help
  either; what the tests need is drafts that pass at ranks 0 and > 0, which happens (seed 3)."""
  c = tiny_config(kind, n_future=4)
  c.model.max_len = 64
  m = build_model(c)
  return m.args, random_params(m, seed=3)


def random_params(model, seed: int = 0):
  """Params with the structure of `init_params` (traced with eval_shape, nothing compiled), drawn
  with numpy: compiling the real initialiser (threefry for every leaf) costs seconds per config
  on a CPU. Matrices ~ N(0, 1/d_model); norm scales ~ 1 + N(0, 0.2^2), not ones, so where a
  norm sits changes the outputs (pre_norm vs post_norm, shared vs per-module head norm).
  test_model checks the real initialiser once."""
  shapes = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
  rng = np.random.default_rng(seed)
  d = model.args.d_model

  def draw(path, s):
    name = path[-1].key
    if name in ("scale", "norm"):
      return (1 + 0.2 * rng.standard_normal(s.shape)).astype(s.dtype)
    return (rng.standard_normal(s.shape) / np.sqrt(d)).astype(s.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def tiny_model(config, seed: int = 0):
  """(model, params) for a config; build_model validates it."""
  model = build_model(config)
  return model, random_params(model, seed)


@pytest.fixture(scope="session")
def make_config():
  """Factory: make_config(kind="parallel", n_future=2) -> a fresh, mutable tiny config."""
  return tiny_config


@pytest.fixture(scope="session")
def make_model():
  """Factory: make_model(config, seed=0) -> (model, params), params as random_params."""
  return tiny_model


def copy_code_corpus(root) -> dict:
  """The json package's .py files copied to root/code (a text_folder corpus of real code), with
  root/datasets for its tfds build and root/jax_cache for compiled programs."""
  folder = root / "code"
  folder.mkdir()
  src = os.path.dirname(json.__file__)
  for name in sorted(os.listdir(src)):
    if name.endswith(".py"):
      shutil.copy(os.path.join(src, name), folder / name)
  return {"folder": str(folder), "data_dir": str(root / "datasets"),
          "cache": str(root / "jax_cache")}


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_cmd(corpus, workdir, *overrides) -> list[str]:
  """`python -m mtp_jax.train` on configs/tiny.py over a copy_code_corpus corpus."""
  return [sys.executable, "-m", "mtp_jax.train", "--config", os.path.join(REPO, "configs/tiny.py"),
          "--workdir", str(workdir), "--config.data.corpus=text_folder",
          f"--config.data.folder={corpus['folder']}", f"--config.data.dir={corpus['data_dir']}",
          "--config.data.val_percent=20", *overrides]


def sweep_cmd(sweep_file, root, corpus, *args) -> list[str]:
  """experiments/sweep.py over a copy_code_corpus corpus (--set last: `args` may add to it)."""
  return [sys.executable, os.path.join(REPO, "experiments", "sweep.py"), "--sweep",
          str(sweep_file), "--root", str(root), *args, "--set", "data.corpus=text_folder",
          f"data.folder={corpus['folder']}", f"data.dir={corpus['data_dir']}",
          "data.val_percent=20"]


def micro_sweep(path, runs: str):
  """Writes a sweep file at `path`: experiments/sweeps/micro.py's BASE_CONFIG and COMMON, and
  get_runs() returning `runs`, Python over `micro` (that file, loaded)."""
  micro = os.path.join(REPO, "experiments", "sweeps", "micro.py")
  with open(path, "w") as f:
    f.write("import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('micro', {micro!r})\n"
            "micro = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(micro)\n"
            "BASE_CONFIG, COMMON = micro.BASE_CONFIG, micro.COMMON\n"
            f"def get_runs():\n  return {runs}\n")
  return path


# A small 7B-shaped model (configs/paper_7b_n4.py shrunk): what the ahead-of-time compile tests
# (tests/tpu, tests/gpu) hand plan_memory.py for a target's abstract devices.
SMALL_7B = {"model.vocab_size": 256, "model.d_model": 256, "model.n_heads": 2,
            "model.n_kv_heads": 2, "model.d_ff": 256, "model.n_layers": 5, "model.n_future": 2,
            "model.max_len": 256, "data.seq_len": 256, "loss.token_chunks": 2,
            "train.grad_accum": 2}


def plan_small_7b(target: str, out, *extra: str) -> int:
  """experiments/plan_memory.py's main (loaded by path, in this process) on SMALL_7B for
  `target`, FSDP over 4 devices, batch 8, the JSON to `out`; `extra` flags go before the
  overrides. Its exit status."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "plan_memory", os.path.join(REPO, "experiments", "plan_memory.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  argv = ["--config", os.path.join(REPO, "configs", "paper_7b_n4.py"), "--target", target,
          "--mesh", "fsdp=4", "--batch", "8", "--no_baseline", *extra, "--json", str(out)]
  return module.main(argv + [a for k, v in SMALL_7B.items() for a in ("--set", f"{k}={v}")])


def bench_accel_on_sequential_workdir(target: str, tmp_path, a_batch: float) -> dict:
  """`bench_accel.py --target TARGET --workdir W` (in this process, batch 1 alone) on a workdir of
  bench_accel's tiny size with 4 sequential heads (SmolLM2's kind), a_batch read from a
  bench_decode-shaped grid JSON; the record. tests/tpu and tests/gpu, after aot.prepare_env."""
  from experiments import aot_decode, bench_accel
  from mtp_jax.workdir import write_config
  c = bench_accel.make_config("tiny", 4, "float32", 1, [])
  c.model.heads.kind = "sequential"
  wd = tmp_path / "seq_wd"
  wd.mkdir()
  write_config(c, str(wd))
  acc = tmp_path / "grid.json"
  acc.write_text(json.dumps([{"batch": 1, "heads": 4, "prompt_len": 16, "mode": "greedy",
                              "a": a_batch, "a_batch": a_batch, "step": 48}]))
  batches, aot_decode.BATCHES = aot_decode.BATCHES, (1,)
  try:
    return bench_accel.main(["--target", target, "--workdir", str(wd), "--acceptance", str(acc),
                             "--acceptance_prompt_len", "16", "--context", "16"])
  finally:
    aot_decode.BATCHES = batches


def force_costs(monkeypatch, seconds, loop_seconds=None):
  """auto's cost model on given costs: seconds(window) -> a window's forward time (a Tree or
  Dynamic; the chain of k for a chain), for `costmodel.forward_times`; loop_seconds(window)
  (default: seconds) its probe's measured cycle (no fixed part); the probes' acceptance stays
  real. Returns the windows timed, in order."""
  from mtp_jax.decoding import costmodel, session
  timed, run_probes = [], session.Session._run_probes
  loop_seconds = loop_seconds or seconds

  def forward_times(params, args, trees, **kw):
    timed.extend(trees)
    return {t: seconds(t) for t in trees}

  def probes(self, prompts, windows, **kw):
    got = run_probes(self, prompts, windows, **kw)
    return [(r, loop_seconds(costmodel.chain(k) if tree is None else tree), 0.0)
            for (tree, k), (r, _, _) in zip(windows, got)]

  monkeypatch.setattr(costmodel, "forward_times", forward_times)
  monkeypatch.setattr(session.Session, "_run_probes", probes)
  return timed
