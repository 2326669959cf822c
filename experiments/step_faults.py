"""What the kernel does for each train step: wall, user and system seconds, minor page faults and
transparent huge pages faulted in (`thp_fault_alloc` of /proc/vmstat), step by step.

    python experiments/step_faults.py [--n_future 4] [--steps 8] [--one_core] \\
        [--json out/step_faults.json]
    MTP_JAX_MIMALLOC=0 python experiments/step_faults.py ...   # glibc's malloc, for contrast

Under the CPU defaults (`runtime.apply_cpu_defaults`: the XLA flag, huge pages, mimalloc), the
default config's projection-heads step on one random batch, back to back after two warm-up
steps. With glibc's malloc XLA:CPU's one block of temporaries (~1 GB here) is mapped and
faulted in again at every step (~500 huge pages, 0.1-2 s of system time a step on a KVM guest,
docs/cpu_speed.md); with mimalloc none after the first (it never gives memory back:
MIMALLOC_PURGE_DELAY=-1). `--one_core`: CPU 0 only, dots on one thread, no batch slices (as
experiments/profile_train.py).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX starts
  from experiments import common
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()
  if "--one_core" in sys.argv:
    common.one_core_before_jax()

import argparse
import resource
import time

import jax
import numpy as np

from experiments import common
from experiments.bench_train import setup


def thp_faults() -> int:
  """Transparent huge pages faulted in so far, machine-wide (0 where /proc/vmstat lacks it)."""
  try:
    with open("/proc/vmstat") as f:
      return next((int(line.split()[1]) for line in f if line.startswith("thp_fault_alloc ")), 0)
  except OSError:
    return 0


def measure(config: str, kind: str, n: int, steps: int, one_core: bool) -> dict:
  box = setup(config, kind, n, ["train.batch_slices=1"] if one_core else [])
  step, state, batch = box["step"], box["state"], box["batch"]
  rows = []
  for i in range(2 + steps):
    r0, t, v0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), thp_faults()
    state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    wall, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    if i >= 2:
      rows.append({"wall_s": round(wall, 4), "user_s": round(r1.ru_utime - r0.ru_utime, 4),
                   "sys_s": round(r1.ru_stime - r0.ru_stime, 4),
                   "minor_faults": r1.ru_minflt - r0.ru_minflt, "thp_faults": thp_faults() - v0})
  med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
  return {"config": config, "kind": kind, "n_future": n, "one_core": one_core,
          "ld_preload": os.environ.get("LD_PRELOAD", ""),
          "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "median": med,
          "max_sys_s": max(r["sys_s"] for r in rows), "steps": rows}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="configs/default.py")
  p.add_argument("--kind", default="projection")
  p.add_argument("--n_future", default="4")
  p.add_argument("--steps", type=int, default=8, help="steps measured after 2 warm-up steps")
  p.add_argument("--one_core", action="store_true", help="CPU 0, one thread, no batch slices")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  ns = common.positive_ints(p, "--n_future", args.n_future)
  if args.steps < 1:
    p.error(f"--steps: a positive integer, got {args.steps}")
  records = [measure(args.config, args.kind, n, args.steps, args.one_core) for n in ns]
  for r in records:
    m = r["median"]
    print(f"n_future {r['n_future']}: step {m['wall_s']:.3f} s, user {m['user_s']:.3f}, "
          f"sys {m['sys_s']:.3f} (max {r['max_sys_s']:.3f}), {m['minor_faults']:.0f} minor "
          f"faults, {m['thp_faults']:.0f} huge pages a step; LD_PRELOAD={r['ld_preload'] or '-'}",
          file=sys.stderr)
  common.emit(records, args.json)


if __name__ == "__main__":
  main()
