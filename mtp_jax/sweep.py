"""Scaling-law sweeps: many `python -m mtp_jax.train` runs from one sweep file, then one table.

A sweep file is a Python file loaded by path:

    BASE_CONFIG = "configs/default.py"       # relative to the working directory or the repo
    COMMON = {"train.steps": 300}            # optional: every run, not part of the names
    def get_runs():                          # one dict of config overrides per run
      return [{"model.d_model": 128, "model.n_layers": 4, "model.n_future": 4, "seed": 0}, ...]

A run is named from its overrides (`d_model=128,n_layers=4,n_future=4,seed=0`) unless its dict
has a "name". `run_sweep` trains each run in ROOT/NAME (log in ROOT/NAME/train.log), `parallel`
at a time, skips runs whose summary.json says they finished, resumes the others (the train CLI
resumes from the workdir's checkpoint), reports a failed run and goes on, and writes
ROOT/sweep.json (runs and status) and ROOT/results.csv. Results, fits and plots are in
`mtp_jax.scaling` (re-exported here: `gather_results`, `fit_power_law`, `analyze`). Neither
module imports jax or tfds: a rerun that skips everything costs no start-up.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Callable

from mtp_jax import scaling

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the train CLI prints once data and checkpoint are ready (run.py): past this line a run no
# longer builds the dataset, so the next run may start.
_STARTED = re.compile(r"^(starting|resuming at) step ", re.M)


@dataclasses.dataclass
class Run:
  name: str
  overrides: dict[str, Any]  # the run's own overrides; they make its name


@dataclasses.dataclass
class Sweep:
  path: str
  base_config: str  # absolute path of the config file every run starts from
  common: dict[str, Any]  # overrides of every run (COMMON, then the caller's extra)
  runs: list[Run]

  def overrides(self, run: Run) -> dict[str, Any]:
    return {**self.common, **run.overrides}


def flag_value(value: Any) -> str:
  """An override as the train CLI parses it (absl: lower-case booleans, tuples as "(1, 2)")."""
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, list):
    value = tuple(value)
  return str(value)


def run_name(overrides: dict[str, Any]) -> str:
  """`d_model=128,n_future=4,seed=0`: the last part of each key, in the order given; characters a
  path should not hold become "_"."""
  parts = [f"{key.rsplit('.', 1)[-1]}={flag_value(v)}" for key, v in overrides.items()]
  return _safe(",".join(parts)) or "base"


def _safe(name: str) -> str:
  return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name).lstrip(".")


def _resolve(path: str, sweep_dir: str) -> str:
  for base in (os.getcwd(), REPO, sweep_dir):
    candidate = os.path.join(base, os.path.expanduser(path))
    if os.path.isfile(candidate):
      return os.path.abspath(candidate)
  raise ValueError(f"BASE_CONFIG: {path!r} not found (tried the working directory, {REPO} and "
                   f"{sweep_dir})")


def load_sweep(path: str, extra: dict[str, Any] | None = None) -> Sweep:
  """Loads a sweep file; `extra` overrides are added to every run (after COMMON) and, like
  COMMON, stay out of the run names. Raises ValueError on a malformed file."""
  if not os.path.isfile(path):
    raise ValueError(f"--sweep: no such file {path!r}")
  spec = importlib.util.spec_from_file_location(
      "mtp_jax_sweep_" + os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not isinstance(getattr(module, "BASE_CONFIG", None), str):
    raise ValueError(f"{path}: needs BASE_CONFIG = 'configs/....py'")
  if not callable(getattr(module, "get_runs", None)):
    raise ValueError(f"{path}: needs def get_runs() -> list[dict]")
  common = {**dict(getattr(module, "COMMON", {})), **(extra or {})}
  runs = []
  for i, spec_dict in enumerate(module.get_runs()):
    overrides = dict(spec_dict)
    name = _safe(str(overrides.pop("name", ""))) or run_name(overrides)
    for key in list(overrides) + list(common):
      if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", key):
        raise ValueError(f"{path}: run {i} ({name}): {key!r} is not a config field like "
                         "'model.d_model'")
    runs.append(Run(name, overrides))
  names = [r.name for r in runs]
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:
    raise ValueError(f"{path}: runs share a name ({', '.join(dupes)}); give them a 'name'")
  if not runs:
    raise ValueError(f"{path}: get_runs() returned no runs")
  return Sweep(os.path.abspath(path), _resolve(module.BASE_CONFIG, os.path.dirname(path)),
               common, runs)


def train_command(sweep: Sweep, run: Run, workdir: str) -> list[str]:
  return [sys.executable, "-m", "mtp_jax.train", "--config", sweep.base_config,
          "--workdir", workdir] + [f"--config.{k}={flag_value(v)}"
                                   for k, v in sweep.overrides(run).items()]


def _norm(value: Any) -> Any:
  """A config value or override, comparable across JSON and command-line spellings."""
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, (list, tuple)):
    value = tuple(value)
  try:
    return float(value)
  except (TypeError, ValueError):
    text = flag_value(value).replace(" ", "")
    return text.lower() if text.lower() in ("true", "false") else text


def _same(saved: Any, wanted: Any) -> bool:
  a, b = _norm(saved), _norm(wanted)
  if isinstance(a, float) and isinstance(b, float):
    return math.isclose(a, b, rel_tol=1e-9)
  return a == b


def check_workdir(sweep: Sweep, run: Run, workdir: str) -> tuple[str, str]:
  """(state, detail): "finished", "resume" (checkpoints there), "new", or "mismatch" (the
  workdir's config.json disagrees with the run's overrides: resuming would mix two runs)."""
  saved = scaling.read_json(os.path.join(workdir, "config.json"))
  if saved is not None:
    for key, wanted in sweep.overrides(run).items():
      value = saved
      for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
      if value is not None and not _same(value, wanted):
        return "mismatch", (f"{workdir} holds a run with {key}={flag_value(value)}, the sweep "
                            f"asks for {flag_value(wanted)}: remove it or rename the run")
  summary = scaling.read_json(os.path.join(workdir, "summary.json"))
  overrides = sweep.overrides(run)
  if summary and not summary.get("interrupted") and summary.get("step") == summary.get("steps"):
    wanted = overrides.get("train.steps")
    if wanted is None or int(wanted) == summary["steps"]:
      return "finished", f"step {summary['step']}"
  ckpts = os.path.join(workdir, "checkpoints")
  steps = [int(n) for n in os.listdir(ckpts) if n.isdigit()] if os.path.isdir(ckpts) else []
  if steps:
    return "resume", f"from step {max(steps)}"
  return "new", ""


def _fmt_secs(s: float) -> str:
  s = int(round(s))
  if s >= 3600:
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s"
  return f"{s // 60}m{s % 60:02d}s"


def _tail(path: str, lines: int = 12) -> str:
  try:
    with open(path, errors="replace") as f:
      return "\n".join(f.read().splitlines()[-lines:])
  except OSError:
    return ""


def _cpu_sets(parallel: int) -> list[set[int]]:
  """The CPUs this process may use, split into `parallel` contiguous groups (shared round-robin
  when there are fewer CPUs than runs)."""
  cpus = sorted(os.sched_getaffinity(0))
  if parallel >= len(cpus):
    return [{cpus[i % len(cpus)]} for i in range(parallel)]
  size, extra = divmod(len(cpus), parallel)
  out, start = [], 0
  for i in range(parallel):
    end = start + size + (i < extra)
    out.append(set(cpus[start:end]))
    start = end
  return out


def _write_json(path: str, obj: Any):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


def run_sweep(sweep: Sweep, root: str, parallel: int = 1, *, dry_run: bool = False,
              pin_cpus: bool = True, env: dict[str, str] | None = None,
              log: Callable[[str], None] = print) -> dict:
  """Trains every run of `sweep` under `root`; returns the record written to root/sweep.json.

  parallel > 1 runs that many subprocesses at once. With `pin_cpus` (Linux), each concurrent
  slot gets its own share of this process's CPUs by affinity (os.sched_setaffinity), and XLA:CPU
  sizes its thread pool from the affinity mask, so P runs on C cores use C/P threads each
  instead of P*C threads fighting. On an accelerator, keep parallel at 1 (each process would
  claim most of the device's memory). The first run starts alone until it has its data ready,
  so the dataset is built once, not by P processes at once. JAX_COMPILATION_CACHE_DIR defaults
  to root/.jax_cache, so a resumed run does not compile again.
  """
  if parallel < 1:
    raise ValueError(f"--parallel: must be >= 1, got {parallel}")
  root = os.path.abspath(root)
  records = []
  for run in sweep.runs:
    workdir = os.path.join(root, run.name)
    state, detail = check_workdir(sweep, run, workdir)
    records.append({"name": run.name, "overrides": run.overrides, "workdir": workdir,
                    "command": train_command(sweep, run, workdir), "state": state,
                    "detail": detail,
                    "status": {"finished": "skipped", "mismatch": "failed"}.get(state, "pending"),
                    "returncode": None, "seconds": None,
                    "error": detail if state == "mismatch" else None})
  n = len(records)
  if dry_run:
    for i, r in enumerate(records):
      what = {"finished": "skip (finished)", "resume": "resume", "new": "train",
              "mismatch": "FAIL"}[r["state"]]
      log(f"[{i + 1}/{n}] {r['name']}: {what} {r['detail']}".rstrip()
          + f"\n    {' '.join(r['command'])}")
    return {"sweep": sweep.path, "root": root, "runs": records}

  os.makedirs(root, exist_ok=True)
  env = dict(os.environ, **(env or {}))
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(root, ".jax_cache"))
  pin = pin_cpus and parallel > 1 and hasattr(os, "sched_setaffinity")
  free_slots = list(range(parallel))
  cpu_sets = _cpu_sets(parallel) if pin else None
  record = {"sweep": sweep.path, "base_config": sweep.base_config, "common": sweep.common,
            "root": root, "parallel": parallel, "runs": records}
  t0, finished, trained_secs = time.time(), 0, []
  queue = []
  for r in records:
    if r["status"] == "pending":
      queue.append(r)
      continue
    finished += 1
    log(f"[{finished}/{n}] {r['name']}: " + ("skipped, finished earlier" if r["status"] ==
                                            "skipped" else f"FAILED: {r['error']}"))
  running: dict[str, tuple[subprocess.Popen, int, Any, float, int]] = {}
  started = False  # has a run of this invocation got past its data set-up?

  def launch(r):
    slot = free_slots.pop(0)
    os.makedirs(r["workdir"], exist_ok=True)
    path = os.path.join(r["workdir"], "train.log")
    logf = open(path, "a")
    logf.write(f"=== sweep {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(r['command'])}\n")
    logf.flush()
    offset = logf.tell()
    cpus = cpu_sets[slot] if pin else None
    proc = subprocess.Popen(r["command"], stdout=logf, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus))
                            if pin else None)
    r["status"] = "running"
    running[r["name"]] = (proc, slot, logf, time.time(), offset)
    log(f"    {r['name']}: " + (f"resume {r['detail']}" if r["state"] == "resume" else "start")
        + (f" on CPUs {sorted(cpus)}" if pin else ""))

  def finish(name, rc):
    nonlocal finished
    proc, slot, logf, t_start, _ = running.pop(name)
    logf.close()
    free_slots.append(slot)
    free_slots.sort()
    r = next(r for r in records if r["name"] == name)
    secs = time.time() - t_start
    r["returncode"], r["seconds"] = rc, round(secs, 1)
    summary = scaling.read_json(os.path.join(r["workdir"], "summary.json")) or {}
    if rc == 0 and summary.get("step") == summary.get("steps") and not summary.get("interrupted"):
      r["status"] = "done"
      trained_secs.append(secs)
    elif rc == 0:
      r["status"], r["error"] = "interrupted", f"stopped at step {summary.get('step')}"
    else:
      r["status"] = "failed"
      r["error"] = _tail(os.path.join(r["workdir"], "train.log"))
    finished += 1
    elapsed = time.time() - t0
    left = n - finished
    eta = (f"ETA {_fmt_secs(sum(trained_secs) / len(trained_secs) * left / parallel)}"
           if trained_secs and left else "ETA ?" if left else "")
    log(f"[{finished}/{n}] {name}: {r['status']} in {_fmt_secs(secs)} (exit {rc}) | elapsed "
        f"{_fmt_secs(elapsed)} {eta}".rstrip())
    if r["status"] == "failed":
      log("    " + r["error"].replace("\n", "\n    "))
    _write_json(os.path.join(root, "sweep.json"), record)

  def on_sigterm(*_):
    raise KeyboardInterrupt
  try:  # `kill` of the sweep stops its runs cleanly too, as Ctrl-C does
    old_handler = signal.signal(signal.SIGTERM, on_sigterm)
  except ValueError:  # not the main thread
    old_handler = None
  try:
    _write_json(os.path.join(root, "sweep.json"), record)
    while queue or running:
      while queue and free_slots and (started or not running):
        launch(queue.pop(0))
      time.sleep(0.2)
      for name in list(running):
        proc, _, logf, _, offset = running[name]
        if not started:
          with open(logf.name, errors="replace") as f:
            f.seek(offset)
            started = bool(_STARTED.search(f.read()))
        rc = proc.poll()
        if rc is not None:
          finish(name, rc)
  except KeyboardInterrupt:
    log(f"interrupted: stopping {len(running)} run(s); each saves a checkpoint, rerun to resume")
    for proc, *_ in running.values():
      proc.terminate()  # SIGTERM: the train loop saves at the next step boundary
    for name in list(running):
      finish(name, running[name][0].wait())
    for r in queue:
      r["status"] = "interrupted"
    _write_json(os.path.join(root, "sweep.json"), record)
    scaling.gather_results(root)
    raise
  finally:
    if old_handler is not None:
      signal.signal(signal.SIGTERM, old_handler)
  counts = {s: sum(r["status"] == s for r in records) for s in ("done", "skipped", "failed",
                                                                 "interrupted")}
  record["seconds"] = round(time.time() - t0, 1)
  _write_json(os.path.join(root, "sweep.json"), record)
  scaling.gather_results(root)
  log(f"sweep: {counts['done']} trained, {counts['skipped']} skipped, {counts['failed']} failed"
      + (f", {counts['interrupted']} interrupted" if counts["interrupted"] else "")
      + f" in {_fmt_secs(record['seconds'])}; {os.path.join(root, 'results.csv')}")
  return record


# What a notebook reaches for after a sweep, from the module that computes it.
fit_power_law, analyze = scaling.fit_power_law, scaling.analyze
gather_results, read_results = scaling.gather_results, scaling.read_results
