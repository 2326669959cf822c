"""Sandbox throughput: the 164 canonical HumanEval solutions through `mtp_jax.evaluation.sandbox`,
timed.

    python experiments/bench_sandbox.py --workers 2 [--repeats 3] [--limit N] [--out FILE]

Prints JSON: programs/s (best and median over repeats), what the machine enforces (seccomp,
Landlock ABI) and that every program passed. The goal (issue 14) is >= 20 programs/s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from experiments import common
from mtp_jax.evaluation import code_tasks, sandbox


SMOKE = {"limit": 8, "repeats": 1}  # --smoke: the suite's run


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workers", type=int, default=2)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--limit", type=int, default=0, help="the first N problems only (0: all 164)")
  ap.add_argument("--out", default="")
  common.add_flag_table(ap, [], SMOKE)
  a = ap.parse_args(argv)
  common.apply_smoke(ap, a, SMOKE)
  problems = code_tasks.humaneval_problems()[:a.limit or None]
  programs = [p.program(p.canonical) for p in problems]
  rates, passed = [], []
  for _ in range(a.repeats):
    t0 = time.perf_counter()
    outs = sandbox.run_many(programs, sandbox.Limits(), workers=a.workers)
    rates.append(len(programs) / (time.perf_counter() - t0))
    passed.append(sum(o.passed for o in outs))
  result = {"programs": len(programs), "workers": a.workers, "cpus": os.cpu_count(),
            "programs_per_s_best": round(max(rates), 1),
            "programs_per_s_median": round(statistics.median(rates), 1),
            "all_passed": all(p == len(programs) for p in passed),
            "sandbox": sandbox.confinement(), "python": platform.python_version()}
  common.emit(result, a.out, indent=1)


if __name__ == "__main__":
  main()
