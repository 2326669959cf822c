"""Sweeps on a Slurm cluster: a sweep's pending runs as ONE `sbatch --array` job.

    python experiments/sweep.py --sweep S --root ROOT --launcher slurm \
        [--slurm_args="-p gpu --gpus=1 --time=4:00:00"] [--parallel P] [--no_wait]

`run_sweep` plans as the local launcher does (`sweep.plan`: finished runs skipped, a mismatched
workdir failed), then:
- follows the tasks of ROOT's earlier arrays still in the queue instead of submitting their runs
  again (a rerun while an array runs, or after --no_wait, attaches to it); tasks still
  COMPLETING (cancelled, saving) are waited for first, so that the plan sees their checkpoint;
- writes ROOT/slurm/array_K.sh (the sbatch script, resubmittable by hand) and array_K.json (its
  manifest: each task's run, workdir, train command, log) and submits the other pending runs as
  one array (at most P at once with `parallel`); task i runs `python -m mtp_jax.sweeps.slurm
  array_K.json i`, which appends the train command's output to ROOT/NAME/train.log (after the
  local scheduler's header line), forwards SIGTERM to it, and writes its exit status and
  seconds to array_K_i.result.json;
- waits, polling `squeue -j` and the result files, with the local launcher's progress lines
  (`sweep.Progress`), then writes ROOT/sweep.json and ROOT/results.csv as the local launcher
  does (sweep.json also names the Slurm jobs: "slurm").

A task cancelled (scancel), killed at its time limit or lost with its node leaves its run's
checkpoints; the next call resubmits the run and the train CLI resumes from them. The script
asks for SIGTERM 120 s before a time limit (`--signal=B:TERM@120`; the task forwards it and
training saves a checkpoint). The tasks get the caller's environment (`--export=ALL`: what it
has, JAX_PLATFORMS included, and nothing more, but JAX_COMPILATION_CACHE_DIR defaulting to
ROOT/.jax_cache as in a local sweep, and without the SLURM_* variables of a job the caller runs
in). Each task is one process; the runs of a sweep are single-process (a multi-process run is
`srun`'s: docs/slurm.md).

Plain sbatch rather than submitit: submitit follows its jobs with `sacct`, which needs Slurm's
accounting database (slurmdbd); clusters without one, the single-node Slurm of the tests
included, cannot report a state to it. It also pickles a Python callable per job, while a
sweep's run is a command line (the train CLI) that an sbatch script runs as it is and a user can
read and resubmit. squeue (`-t all -r`) and the result files are all this needs; no dependency.
Imports no jax, as the other sweep modules.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from mtp_jax.sweeps import scaling
from mtp_jax.sweeps import scheduler
from mtp_jax.sweeps import sweep as sweep_lib

# squeue's states of a task that ended (`squeue -t all` keeps them for MinJobAge seconds; after
# that the task is gone: it ended too). Any other state (PENDING, RUNNING, COMPLETING, ...) is
# a task that may still run.
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                   "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"})
TERM_BEFORE_LIMIT_S = 120
SQUEUE_PATIENCE_S = 300  # squeue failing this long in a row stops the wait (the array goes on)


class SlurmError(RuntimeError):
  """A Slurm command failed (sbatch refused the job, squeue unreachable); the message says how."""


@dataclasses.dataclass
class Task:
  """One array task: the run it trains and where its files are."""
  name: str
  workdir: str
  command: list[str]
  log: str  # ROOT/NAME/train.log
  result: str  # its exit status, seconds and node, written by run_task
  index: int
  job: str = ""  # the array's job id, once submitted

  @property
  def id(self) -> str:
    return f"{self.job}_{self.index}"


def slurm_command(*args: str, env: dict[str, str] | None = None,
                  timeout: float = 60) -> subprocess.CompletedProcess:
  if shutil.which(args[0]) is None:
    raise SlurmError(f"{args[0]} not found: --launcher slurm needs Slurm's client commands "
                     "(sbatch, squeue) on PATH")
  return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout,
                        stdin=subprocess.DEVNULL)


def task_states(job: str) -> dict[str, tuple[str, str]]:
  """{"JOB_INDEX": (state, node)} for each task of array `job` that squeue still knows."""
  p = slurm_command("squeue", "-h", "-t", "all", "-r", "-j", job, "-o", "%i|%T|%N")
  if p.returncode != 0:
    if "Invalid job id" in p.stderr:  # ended longer than MinJobAge ago
      return {}
    raise SlurmError(f"squeue -j {job}: {p.stderr.strip() or p.returncode}")
  out = {}
  for line in p.stdout.splitlines():
    task, state, node = (line.split("|") + ["", ""])[:3]
    out[task.strip()] = (state.strip(), node.strip())
  return out


def _manifests(slurm_dir: str) -> list[tuple[int, str]]:
  """(K, path) of each array_K.json, by K."""
  found = ((re.fullmatch(r"array_(\d+)\.json", os.path.basename(p)), p)
           for p in glob.glob(os.path.join(slurm_dir, "array_*.json")))
  return sorted((int(m.group(1)), p) for m, p in found if m)


def earlier_tasks(slurm_dir: str) -> list[tuple[Task, str]]:
  """(task, state) for every task of this root's earlier arrays that has not ended."""
  out = []
  for _, path in _manifests(slurm_dir):
    manifest = scaling.read_json(path) or {}
    if not manifest.get("job_id"):
      continue
    states = task_states(manifest["job_id"])
    for t in manifest["tasks"]:
      task = Task(**t, job=manifest["job_id"])
      state = states.get(task.id, ("", ""))[0]
      if state and state not in ENDED:
        out.append((task, state))
  return out


def write_array(sweep: sweep_lib.Sweep, slurm_dir: str, records: list[sweep_lib.RunRecord],
                parallel: int | None) -> tuple[str, str, list[Task]]:
  """(script, manifest, tasks): array_K.sh and array_K.json, K one past the last one there."""
  os.makedirs(slurm_dir, exist_ok=True)
  manifests = _manifests(slurm_dir)
  k = manifests[-1][0] + 1 if manifests else 0
  base = os.path.join(slurm_dir, f"array_{k}")
  tasks = [Task(r.name, r.workdir, r.command, os.path.join(r.workdir, "train.log"),
                f"{base}_{i}.result.json", i) for i, r in enumerate(records)]
  sweep_lib.write_json(base + ".json", {"sweep": sweep.path,
                                        "tasks": [_task_fields(t) for t in tasks]})
  name = os.path.splitext(os.path.basename(sweep.path))[0]
  throttle = f"%{parallel}" if parallel else ""
  with open(base + ".sh", "w") as f:
    f.write(f"""#!/bin/bash
# Written by experiments/sweep.py --launcher slurm (mtp_jax/sweeps/slurm.py): the runs of sweep
# {sweep.path}
# not finished at submission, as one job array. Task i trains tasks[i] of array_{k}.json, its
# output appended to the run's train.log, its exit status in array_{k}_i.result.json. Options
# given to sbatch (--slurm_args) override these.
#SBATCH --job-name=sweep-{name}
#SBATCH --array=0-{len(tasks) - 1}{throttle}
#SBATCH --output={base}_%a.out
#SBATCH --signal=B:TERM@{TERM_BEFORE_LIMIT_S}
#SBATCH --export=ALL
exec {shlex.quote(sys.executable)} -m mtp_jax.sweeps.slurm {shlex.quote(base + ".json")} \
"$SLURM_ARRAY_TASK_ID"
""")
  return base + ".sh", base + ".json", tasks


def _task_fields(task: Task) -> dict:
  return {k: v for k, v in dataclasses.asdict(task).items() if k != "job"}


def submit(script: str, manifest: str, slurm_args: list[str], env: dict[str, str]) -> str:
  """sbatch's job id for the array; recorded in the manifest."""
  p = slurm_command("sbatch", "--parsable", *slurm_args, script, env=env)
  job = p.stdout.strip().split(";")[0]
  if p.returncode != 0 or not job.isdigit():
    for path in (script, manifest):  # never submitted: not an array to follow
      os.remove(path)
    raise SlurmError(f"sbatch {' '.join(slurm_args)} {script}: "
                     f"{(p.stderr or p.stdout).strip() or p.returncode}")
  sweep_lib.write_json(manifest, {**scaling.read_json(manifest), "job_id": job})
  return job


def _wait_completing(slurm_dir: str, log: Callable[[str], None], timeout: float = 600) -> None:
  """Earlier tasks still COMPLETING (cancelled, their run saving a checkpoint): wait until they
  end, so that the plan sees what they saved."""
  deadline, said = time.time() + timeout, False
  while time.time() < deadline:
    ending = [t.id for t, state in earlier_tasks(slurm_dir) if state == "COMPLETING"]
    if not ending:
      return
    if not said:
      log(f"slurm: waiting for task(s) {', '.join(ending)} to finish ending")
      said = True
    time.sleep(1)


def run_sweep(sweep: sweep_lib.Sweep, root: str, *, slurm_args: str | list[str] = (),
              parallel: int | None = None, wait: bool = True, dry_run: bool = False,
              env: dict[str, str] | None = None, poll_seconds: float = 2.0,
              log: Callable[[str], None] = print) -> dict:
  """Trains every run of `sweep` under `root` as tasks of a Slurm job array; returns the
  record written to root/sweep.json (as sweep.run_sweep's, plus "slurm": the jobs, each run's
  task). `slurm_args`: sbatch options (a string is split as a shell would). `parallel`: at most
  that many tasks at once (the array's %P); None: as the cluster allows. wait=False returns
  once submitted (the runs PENDING); a later call follows the array to its end."""
  if parallel is not None and parallel < 1:
    raise ValueError(f"--parallel: must be >= 1, got {parallel}")
  args = shlex.split(slurm_args) if isinstance(slurm_args, str) else list(slurm_args)
  root = os.path.abspath(root)
  slurm_dir = os.path.join(root, "slurm")
  if dry_run:
    record = sweep_lib.dry_run_record(sweep, root, sweep_lib.plan(sweep, root), log)
    log("slurm: would submit the pending runs as one array: "
        + shlex.join(["sbatch", *args, os.path.join(slurm_dir, "array_K.sh")]))
    return record
  _wait_completing(slurm_dir, log)
  running = {t.name: t for t, _ in earlier_tasks(slurm_dir)}
  progress = sweep_lib.Progress(sweep, root, sweep_lib.plan(sweep, root), parallel, log)
  tracked = {r.name: running[r.name] for r in progress.pending if r.name in running}
  for t in tracked.values():
    log(f"    {t.name}: following slurm task {t.id}, submitted earlier")
  new = [r for r in progress.pending if r.name not in tracked]
  # (SLURM_* of a job this runs in would leak into the tasks: Slurm sets their own)
  run_env = {k: v for k, v in sweep_lib.runs_env(root, env).items()
             if not k.startswith("SLURM_") or k == "SLURM_CONF"}
  if new:
    script, manifest, tasks = write_array(sweep, slurm_dir, new, parallel)
    job = submit(script, manifest, args, run_env)
    log(f"slurm: submitted {len(tasks)} run(s) as array job {job} ({script})")
    for t in tasks:
      t.job = job
      tracked[t.name] = t
  jobs = sorted({t.job for t in tracked.values()}, key=int)
  progress.record["slurm"] = {"jobs": jobs, "sbatch_args": args,
                              "tasks": {name: t.id for name, t in tracked.items()}}
  progress.save()
  if not wait and tracked:
    log(f"slurm: not waiting; rerun this command to follow the array, `scancel "
        f"{' '.join(jobs)}` to stop it")
    return progress.record
  try:
    follow(progress, tracked, poll_seconds)
  except KeyboardInterrupt:
    log(f"interrupted: the array goes on; rerun this command to follow it, `scancel "
        f"{' '.join(jobs)}` to stop it")
    progress.interrupted(mark=False)
    raise
  return progress.close()


def follow(progress: sweep_lib.Progress, tracked: dict[str, Task],
           poll_seconds: float = 2.0) -> None:
  """Until every tracked task has ended: a progress line when one starts (squeue: RUNNING) and
  when one ends (its result file, or squeue says it ended without one: cancelled before its
  run could end, killed, its node lost)."""
  tracked, started, unanswered = dict(tracked), {}, {}
  at_once, last_ok = 1, time.time()
  while tracked:
    states = {}
    try:
      for job in sorted({t.job for t in tracked.values()}):
        states.update(task_states(job))
      last_ok = time.time()
    except (SlurmError, subprocess.TimeoutExpired) as e:
      if time.time() - last_ok > SQUEUE_PATIENCE_S:
        raise SlurmError(f"{e} (for {SQUEUE_PATIENCE_S} s; the array goes on: rerun to follow "
                         "it)") from e
      time.sleep(poll_seconds)
      continue
    at_once = max(at_once, sum(s == "RUNNING" for s, _ in states.values()))
    for name, t in list(tracked.items()):
      state, node = states.get(t.id, ("", ""))
      if state == "RUNNING" and name not in started:
        started[name] = time.time()
        progress.started(name, f"as slurm task {t.id} on {node}")
      result = scaling.read_json(t.result)
      if result is not None:
        progress.ended(name, result["returncode"], result["seconds"], t.log, running=at_once)
      elif state and state not in ENDED:
        continue
      elif unanswered.setdefault(name, 0) < 1:  # once more: a result file may lag on NFS
        unanswered[name] += 1
        continue
      else:
        progress.ended(name, None, time.time() - started.get(name, time.time()), t.log,
                       running=at_once, error=f"slurm task {t.id} ended "
                       f"{state or '(no longer in squeue)'} before its run did; rerun to resume")
      del tracked[name]
    if tracked:
      time.sleep(poll_seconds)


def _startup_lock(manifest_path: str) -> int | None:
  """Until one task of the array has its data ready (array_K.ready), tasks start one at a
  time (an flock on ROOT/slurm/startup.lock), as the local scheduler's first run starts alone:
  the data set is built once, not by every task at once. None: no need, or no flock here."""
  ready = manifest_path[:-len(".json")] + ".ready"
  if os.path.exists(ready):
    return None
  try:
    fd = os.open(os.path.join(os.path.dirname(manifest_path), "startup.lock"),
                 os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
  except OSError:  # a file system without locks: no gate
    return None
  if os.path.exists(ready):
    os.close(fd)
    return None
  return fd


def _release_when_ready(fd: int, manifest_path: str, log_path: str, offset: int,
                        proc: subprocess.Popen) -> None:
  while proc.poll() is None:
    with open(log_path, errors="replace") as f:
      f.seek(offset)
      if sweep_lib.STARTED.search(f.read()):
        open(manifest_path[:-len(".json")] + ".ready", "w").close()
        break
    time.sleep(0.2)
  os.close(fd)  # (releases the flock)


def run_task(manifest_path: str, index: int) -> int:
  """An array task: trains tasks[index] of the manifest, its output appended to the run's
  train.log; SIGTERM and SIGINT are passed on to it (training saves a checkpoint and stops);
  writes the result file. Returns the run's exit status (128 + signal when killed)."""
  with open(manifest_path) as f:
    t = Task(**json.load(f)["tasks"][index])
  t.job = os.environ.get("SLURM_ARRAY_JOB_ID", "")
  node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
  os.makedirs(os.path.dirname(t.log), exist_ok=True)
  lock = _startup_lock(manifest_path)
  t0 = time.time()
  with open(t.log, "a") as log:
    scheduler.log_header(log, f"sweep (slurm task {t.id} on {node})", t.command)
    proc = subprocess.Popen(t.command, stdout=log, stderr=subprocess.STDOUT)
    for s in (signal.SIGTERM, signal.SIGINT):
      signal.signal(s, lambda signum, _: proc.send_signal(signum))
    if lock is not None:
      _release_when_ready(lock, manifest_path, t.log, log.tell(), proc)
    rc = proc.wait()
  sweep_lib.write_json(t.result, {"task": t.id, "node": node, "returncode": rc,
                                  "seconds": round(time.time() - t0, 1)})
  return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
  sys.exit(run_task(sys.argv[1], int(sys.argv[2])))
