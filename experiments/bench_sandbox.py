"""Sandbox throughput: the 164 canonical HumanEval solutions through `mtp_jax.evaluation.sandbox`,
timed.

    python experiments/bench_sandbox.py --workers 2 [--repeats 3] [--out FILE]

Prints JSON: programs/s (best and median over repeats), what the machine enforces (seccomp,
Landlock ABI) and that every program passed. The goal (issue 14) is >= 20 programs/s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_jax import runtime
from mtp_jax.evaluation import code_tasks, sandbox


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workers", type=int, default=2)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  problems = code_tasks.humaneval_problems()
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
  text = json.dumps(runtime.stamp(result), indent=1)
  print(text)
  if a.out:
    with open(a.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
