"""Runs commands as subprocesses, a few at a time, each logging to its own file.

    jobs = [scheduler.Job("a", ["python", "-m", "mtp_jax.train", ...], "runs/a/train.log"), ...]
    scheduler.Scheduler(parallel=2).run(jobs, on_finish=lambda job, rc, secs: ...)

What a sweep needs from its processes and nothing of sweeps: slots, CPU affinity per slot, a
first job that starts alone until its log shows it is ready, and SIGTERM or Ctrl-C forwarded to
the running jobs. Knows nothing of configs or results (mtp_jax.sweeps.sweep); imports no jax.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import time
from typing import IO
from collections.abc import Callable, Sequence


@dataclasses.dataclass
class Job:
  name: str
  command: list[str]
  log_path: str  # stdout and stderr are appended here, after a line naming the command


@dataclasses.dataclass
class _Running:
  job: Job
  proc: subprocess.Popen
  slot: int
  log: IO[str]
  t_start: float
  offset: int  # where this launch's output starts in the log


def log_header(log: IO[str], label: str, command: Sequence[str]) -> None:
  """The line a job's log gets before each launch: `=== LABEL <time>: <command>`."""
  log.write(f"=== {label} {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}\n")
  log.flush()


def cpu_sets(parallel: int) -> list[set[int]]:
  """The CPUs this process may use, split into `parallel` contiguous groups (shared round-robin
  when there are fewer CPUs than slots)."""
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


class Scheduler:
  """Runs jobs in order, `parallel` at a time.

  With `pin_cpus` (Linux, parallel > 1) each slot gets its own share of this process's CPUs by
  affinity (os.sched_setaffinity); XLA:CPU sizes its thread pool from the affinity mask, so P
  jobs on C cores use C/P threads each instead of P*C threads fighting. With `ready`, the first
  job runs alone until its log matches the pattern (for training: its data set is built), so a
  data set is built once, not by P processes at once.
  """

  def __init__(self, parallel: int, *, env: dict[str, str] | None = None, pin_cpus: bool = True,
               ready: re.Pattern | None = None, label: str = "launch"):
    if parallel < 1:
      raise ValueError(f"parallel: must be >= 1, got {parallel}")
    self.parallel = parallel
    self.label = label  # the log's line before each launch: === LABEL <time>: <command>
    self.env = env
    self.pin = pin_cpus and parallel > 1 and hasattr(os, "sched_setaffinity")
    self.cpu_sets = cpu_sets(parallel) if self.pin else None
    self._ready_pattern = ready
    self._ready = ready is None
    self._free = list(range(parallel))
    self._running: dict[str, _Running] = {}

  def _launch(self, job: Job, on_launch) -> None:
    slot = self._free.pop(0)
    os.makedirs(os.path.dirname(os.path.abspath(job.log_path)), exist_ok=True)
    logf = open(job.log_path, "a")  # (closed in _finish)
    log_header(logf, self.label, job.command)
    cpus = self.cpu_sets[slot] if self.pin else None
    proc = subprocess.Popen(job.command, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    self._running[job.name] = _Running(job, proc, slot, logf, time.time(), logf.tell())
    if on_launch:
      on_launch(job, sorted(cpus) if cpus else None)

  def _finish(self, name: str, returncode: int, on_finish) -> None:
    r = self._running.pop(name)
    r.log.close()
    self._free.append(r.slot)
    self._free.sort()
    if on_finish:
      on_finish(r.job, returncode, time.time() - r.t_start)

  def _check_ready(self, r: _Running) -> None:
    with open(r.job.log_path, errors="replace") as f:
      f.seek(r.offset)
      self._ready = bool(self._ready_pattern.search(f.read()))

  def run(self, jobs: Sequence[Job], *,
          on_launch: Callable[[Job, list[int] | None], None] | None = None,
          on_finish: Callable[[Job, int, float], None] | None = None,
          on_interrupt: Callable[[int], None] | None = None,
          poll_seconds: float = 0.2) -> None:
    """Runs every job; on_launch(job, cpus or None) after each start, on_finish(job, returncode,
    seconds) after each end. SIGTERM to this process acts as Ctrl-C: on_interrupt(jobs running)
    is called, the running jobs get SIGTERM (a training run saves a checkpoint at its next
    step), are waited for and reported through on_finish, the jobs not started are dropped, and
    KeyboardInterrupt propagates."""
    queue = list(jobs)

    def on_sigterm(*_):
      raise KeyboardInterrupt
    try:
      old_handler = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread
      old_handler = None
    try:
      while queue or self._running:
        while queue and self._free and (self._ready or not self._running):
          self._launch(queue.pop(0), on_launch)
        time.sleep(poll_seconds)
        for name in list(self._running):
          r = self._running[name]
          if not self._ready:
            self._check_ready(r)
          returncode = r.proc.poll()
          if returncode is not None:
            self._finish(name, returncode, on_finish)
    except KeyboardInterrupt:
      if on_interrupt:
        on_interrupt(len(self._running))
      for r in self._running.values():
        r.proc.terminate()
      for name in list(self._running):
        self._finish(name, self._running[name].proc.wait(), on_finish)
      raise
    finally:
      if old_handler is not None:
        signal.signal(signal.SIGTERM, old_handler)

  @property
  def running(self) -> int:
    return len(self._running)
