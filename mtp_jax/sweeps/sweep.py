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
ROOT/sweep.json (runs and their `RunStatus`) and ROOT/results.csv. The processes are run by
`mtp_jax.sweeps.scheduler` (slots, CPU affinity, signals), or on a Slurm cluster as one job array
by `mtp_jax.sweeps.slurm.run_sweep` (the same `plan` and `Progress`). Results, fits and plots are in
`mtp_jax.sweeps.scaling` (re-exported here: `gather_results`, `fit_power_law`, `analyze`). None of
the three imports jax or tfds: a rerun that skips everything costs no start-up.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import math
import os
import re
import signal
import sys
import time
from typing import Any
from collections.abc import Callable

from mtp_jax.sweeps import scaling
from mtp_jax.sweeps import scheduler
from mtp_jax import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the train CLI prints once data and checkpoint are ready (train.py): past this line a run no
# longer builds the dataset, so the next run may start.
STARTED = re.compile(r"^(starting|resuming at) step ", re.M)


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


class WorkdirState(enum.Enum):
  """What a run's workdir holds before the sweep starts it."""
  FINISHED = "finished"  # summary.json says every step ran: skipped
  RESUME = "resume"  # checkpoints there: the train CLI resumes from the latest
  NEW = "new"
  MISMATCH = "mismatch"  # config.json disagrees with the run's overrides: resuming would mix two


class RunStatus(enum.Enum):
  """A run's status in sweep.json and results.csv (the values are what those files hold)."""
  PENDING = "pending"
  RUNNING = "running"
  DONE = "done"  # trained to the last step by this invocation
  SKIPPED = "skipped"  # finished by an earlier invocation
  FAILED = "failed"
  INTERRUPTED = "interrupted"

  @property
  def ok(self) -> bool:
    """Finished, now or earlier: its summary.json holds final figures."""
    return self in (RunStatus.DONE, RunStatus.SKIPPED)


def check_workdir(sweep: Sweep, run: Run, workdir: str) -> tuple[WorkdirState, str]:
  """(state, detail), detail being why a MISMATCH is one, or where a RESUME starts."""
  saved = scaling.read_json(workdir_lib.config_path(workdir))  # what was saved, not defaults
  if saved is not None:
    for key, wanted in sweep.overrides(run).items():
      value = saved
      for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
      if value is not None and not _same(value, wanted):
        return WorkdirState.MISMATCH, (
            f"{workdir} holds a run with {key}={flag_value(value)}, the sweep asks for "
            f"{flag_value(wanted)}: remove it or rename the run")
  summary = workdir_lib.read_summary(workdir)
  overrides = sweep.overrides(run)
  if summary and not summary.get("interrupted") and summary.get("step") == summary.get("steps"):
    wanted = overrides.get("train.steps")
    if wanted is None or int(wanted) == summary["steps"]:
      return WorkdirState.FINISHED, f"step {summary['step']}"
  steps = workdir_lib.checkpoint_steps(workdir)
  if steps:
    return WorkdirState.RESUME, f"from step {max(steps)}"
  return WorkdirState.NEW, ""


@dataclasses.dataclass
class RunRecord:
  """One run's entry in sweep.json."""
  name: str
  overrides: dict[str, Any]
  workdir: str
  command: list[str]
  state: WorkdirState
  detail: str
  status: RunStatus
  returncode: int | None = None
  seconds: float | None = None
  error: str | None = None

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), "state": self.state.value, "status": self.status.value}


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


def write_json(path: str, obj: Any):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


def plan(sweep: Sweep, root: str) -> list[RunRecord]:
  """A record per run, from what its workdir under `root` holds: finished runs SKIPPED, a
  mismatched workdir FAILED, the others PENDING."""
  records = []
  for run in sweep.runs:
    workdir = os.path.join(root, run.name)
    state, detail = check_workdir(sweep, run, workdir)
    status = {WorkdirState.FINISHED: RunStatus.SKIPPED,
              WorkdirState.MISMATCH: RunStatus.FAILED}.get(state, RunStatus.PENDING)
    records.append(RunRecord(run.name, run.overrides, workdir, train_command(sweep, run, workdir),
                             state, detail, status,
                             error=detail if state == WorkdirState.MISMATCH else None))
  return records


def dry_run_record(sweep: Sweep, root: str, records: list[RunRecord],
                   log: Callable[[str], None]) -> dict:
  what = {WorkdirState.FINISHED: "skip (finished)", WorkdirState.RESUME: "resume",
          WorkdirState.NEW: "train", WorkdirState.MISMATCH: "FAIL"}
  for i, r in enumerate(records):
    log(f"[{i + 1}/{len(records)}] {r.name}: {what[r.state]} {r.detail}".rstrip()
        + f"\n    {' '.join(r.command)}")
  return {"sweep": sweep.path, "root": root, "runs": [r.to_json() for r in records]}


def runs_env(root: str, env: dict[str, str] | None = None) -> dict[str, str]:
  """os.environ and `env`; JAX_COMPILATION_CACHE_DIR defaults to root/.jax_cache."""
  out = dict(os.environ, **(env or {}))
  out.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(root, ".jax_cache"))
  return out


class Progress:
  """What every launcher (the scheduler here, a Slurm array in mtp_jax.sweeps.slurm) does around
  its processes: `[k/n] NAME: ...` lines with elapsed time and ETA, ROOT/sweep.json after each
  change (`record`: a launcher may add fields), ROOT/results.csv and a closing line."""

  def __init__(self, sweep: Sweep, root: str, records: list[RunRecord], parallel: int | None,
               log: Callable[[str], None] = print):
    self.root, self.records, self.log, self.parallel = root, records, log, parallel
    self.by_name = {r.name: r for r in records}
    self.t0, self.finished, self.trained_secs = time.time(), 0, []
    self.record = {"sweep": sweep.path, "base_config": sweep.base_config,
                   "common": sweep.common, "root": root, "parallel": parallel, "runs": []}
    os.makedirs(root, exist_ok=True)
    for r in records:
      if r.status != RunStatus.PENDING:
        self.finished += 1
        log(f"[{self.finished}/{len(records)}] {r.name}: " + (
            "skipped, finished earlier" if r.status == RunStatus.SKIPPED
            else f"FAILED: {r.error}"))
    self.save()

  pending = property(lambda self: [r for r in self.records if r.status == RunStatus.PENDING])

  def save(self) -> None:
    self.record["runs"] = [r.to_json() for r in self.records]
    write_json(os.path.join(self.root, "sweep.json"), self.record)

  def started(self, name: str, where: str = "") -> None:
    """The run is RUNNING; `where` says on what (CPUs, a Slurm task and its node)."""
    r = self.by_name[name]
    r.status = RunStatus.RUNNING
    self.log(f"    {r.name}: " + (f"resume {r.detail}" if r.state == WorkdirState.RESUME
                                  else "start") + (f" {where}" if where else ""))
    self.save()

  def ended(self, name: str, rc: int | None, secs: float, log_path: str,
            running: int | None = None, error: str | None = None) -> RunStatus:
    """The run's process ended with exit status `rc` after `secs` (None: unknown, `error` says
    why): DONE when its summary.json says every step ran, INTERRUPTED when it stopped early or
    was stopped by SIGTERM or SIGINT, FAILED otherwise (with its log's last lines). `running`:
    how many run at once now, for the ETA (default: parallel)."""
    r = self.by_name[name]
    r.returncode, r.seconds = rc, round(secs, 1)
    summary = workdir_lib.read_summary(r.workdir) or {}
    complete = summary.get("step") == summary.get("steps") and not summary.get("interrupted")
    if rc is None or rc in (-signal.SIGTERM, -signal.SIGINT):  # cancelled, Ctrl-C
      r.status, r.error = RunStatus.INTERRUPTED, error or f"killed by {signal.Signals(-rc).name}"
    elif rc == 0 and complete:
      r.status = RunStatus.DONE
      self.trained_secs.append(secs)
    elif rc == 0:
      r.status, r.error = RunStatus.INTERRUPTED, f"stopped at step {summary.get('step')}"
    else:
      r.status, r.error = RunStatus.FAILED, _tail(log_path)
    self.finished += 1
    n, left = len(self.records), len(self.records) - self.finished
    at_once = max(1, running or self.parallel or 1)
    eta = (f"ETA {_fmt_secs(sum(self.trained_secs) / len(self.trained_secs) * left / at_once)}"
           if self.trained_secs and left else "ETA ?" if left else "")
    self.log(f"[{self.finished}/{n}] {r.name}: {r.status.value} in {_fmt_secs(secs)} (exit {rc}) "
             f"| elapsed {_fmt_secs(time.time() - self.t0)} {eta}".rstrip())
    if r.status == RunStatus.FAILED or rc is None:
      self.log("    " + r.error.replace("\n", "\n    "))
    self.save()
    return r.status

  def interrupted(self, mark: bool = True) -> None:
    """On Ctrl-C: sweep.json (the runs not started INTERRUPTED, with `mark`) and results.csv as
    far as they go."""
    for r in self.pending if mark else []:
      r.status = RunStatus.INTERRUPTED
    self.save()
    scaling.gather_results(self.root)

  def close(self) -> dict:
    """Writes the final sweep.json and results.csv, logs the counts; returns the record."""
    self.record["seconds"] = round(time.time() - self.t0, 1)
    self.save()
    scaling.gather_results(self.root)
    counts = {s: sum(r.status == s for r in self.records) for s in RunStatus}
    self.log(f"sweep: {counts[RunStatus.DONE]} trained, {counts[RunStatus.SKIPPED]} skipped, "
             f"{counts[RunStatus.FAILED]} failed"
             + (f", {counts[RunStatus.INTERRUPTED]} interrupted"
                if counts[RunStatus.INTERRUPTED] else "")
             + f" in {_fmt_secs(self.record['seconds'])}; "
             f"{os.path.join(self.root, 'results.csv')}")
    return self.record


def run_sweep(sweep: Sweep, root: str, parallel: int = 1, *, dry_run: bool = False,
              pin_cpus: bool = True, env: dict[str, str] | None = None,
              log: Callable[[str], None] = print) -> dict:
  """Trains every run of `sweep` under `root`; returns the record written to root/sweep.json
  (its runs as `RunRecord.to_json` dicts: statuses are `RunStatus` values).

  parallel > 1 runs that many subprocesses at once, each pinned to its share of the CPUs with
  `pin_cpus` (mtp_jax.sweeps.scheduler). On an accelerator, keep parallel at 1 (each process would
  claim most of the device's memory). The first run starts alone until it has its data ready,
  so the dataset is built once, not by P processes at once. JAX_COMPILATION_CACHE_DIR defaults
  to root/.jax_cache, so a resumed run does not compile again. (A Slurm cluster runs them
  instead with mtp_jax.sweeps.slurm.run_sweep.)
  """
  if parallel < 1:
    raise ValueError(f"--parallel: must be >= 1, got {parallel}")
  root = os.path.abspath(root)
  records = plan(sweep, root)
  if dry_run:
    return dry_run_record(sweep, root, records, log)
  progress = Progress(sweep, root, records, parallel, log)
  sched = scheduler.Scheduler(parallel, env=runs_env(root, env), pin_cpus=pin_cpus,
                              ready=STARTED, label="sweep")

  jobs = [scheduler.Job(r.name, r.command, os.path.join(r.workdir, "train.log"))
          for r in progress.pending]
  try:
    sched.run(jobs, on_launch=lambda job, cpus: progress.started(
                  job.name, f"on CPUs {cpus}" if cpus else ""),
              on_finish=lambda job, rc, secs: progress.ended(job.name, rc, secs, job.log_path),
              on_interrupt=lambda running: log(
                  f"interrupted: stopping {running} run(s); each saves a checkpoint, rerun to "
                  "resume"))
  except KeyboardInterrupt:
    progress.interrupted()
    raise
  return progress.close()


# What a notebook reaches for after a sweep, from the module that computes it.
fit_power_law, analyze = scaling.fit_power_law, scaling.analyze
gather_results, read_results = scaling.gather_results, scaling.read_results
