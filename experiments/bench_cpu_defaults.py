"""Train-step time under the CPU defaults of `mtp_jax.backends.cpu.runtime`, each attention
kernel and remat.

    python experiments/bench_cpu_defaults.py --json experiments/results/bench_cpu_defaults.json
    python experiments/bench_cpu_defaults.py --envs ynn_off+hugetlb --impls cpu \
        --remats none,dots_saveable,full --json experiments/results/bench_cpu_remat.json

XLA flags and glibc tunables are per process, so every (environment, attention_impl) variant is
a worker process that compiles the default-size train step once, then waits; the driver asks the
workers for `--burst` back-to-back steps each, round after round, so machine noise (other jobs on
the same cores) hits all variants alike; a round's figure is the median of a burst's steps after
the first (the first step after idling pays extra kernel time). Reports medians and ratios to the
first variant; quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from experiments import common
from mtp_jax.backends.cpu import runtime

_HEAP = (runtime.HUGETLB
         + ":glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184")
# name -> environment changes; "none" is what a user got before mtp_jax.backends.cpu.runtime.
ENVS = {
    "none": {},
    "ynn_off": {"XLA_FLAGS": runtime.CPU_XLA_FLAGS[0]},
    "hugetlb": {"GLIBC_TUNABLES": runtime.HUGETLB},
    "ynn_off+hugetlb": {"XLA_FLAGS": runtime.CPU_XLA_FLAGS[0], "GLIBC_TUNABLES": runtime.HUGETLB},
    # heap: no mmap, the heap never trimmed, so freed memory could stay in the process; with
    # one_arena (one malloc arena) too, a step stops faulting its ~800 MB of temporaries in
    "ynn_off+hugetlb+heap": {"XLA_FLAGS": runtime.CPU_XLA_FLAGS[0], "GLIBC_TUNABLES": _HEAP},
    "ynn_off+hugetlb+one_arena": {"XLA_FLAGS": runtime.CPU_XLA_FLAGS[0],
                                  "GLIBC_TUNABLES": _HEAP + ":glibc.malloc.arena_max=1"},
    # mimalloc preloaded (what runtime.apply_cpu_defaults does where the wheel is installed)
    "ynn_off+hugetlb+mimalloc": {"XLA_FLAGS": runtime.CPU_XLA_FLAGS[0],
                                 "GLIBC_TUNABLES": runtime.HUGETLB,
                                 "LD_PRELOAD": runtime.mimalloc_path() or "",
                                 **runtime.MIMALLOC_ENV},
}


def worker(args):
  import jax

  from experiments import bench_train
  from mtp_jax.config import load_file
  c = load_file(args.config)
  c.model.heads.kind, c.model.n_future = args.kind, args.n_future
  c.model.attention_impl = args.impl
  c.model.remat_policy = args.remat
  common.apply_overrides(c, args.set)
  run, tokens, _, compile_s = bench_train.jax_run(c)
  print(json.dumps({"ready": True, "compile_s": compile_s, "tokens": tokens,
                    "backend": jax.default_backend()}), flush=True)
  for line in sys.stdin:
    if line.strip() != "step":
      break
    steps = []
    for _ in range(args.burst):  # back to back, as in a training loop
      t, cpu = time.perf_counter(), time.process_time()
      run()
      steps.append((time.perf_counter() - t, time.process_time() - cpu))
    # The first step after the worker sat idle (the other variants' turns) pays extra kernel
    # time (docs/cpu_speed.md); with a burst it is kept apart and the rest are the figure.
    rest = steps[1:] or steps
    print(json.dumps({"s": float(np.median([a for a, _ in rest])),
                      "cpu_s": float(np.median([b for _, b in rest])),
                      "first_s": steps[0][0]}), flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="configs/ntp.py")
  ap.add_argument("--kind", default="parallel")
  ap.add_argument("--n_future", type=int, default=1)
  ap.add_argument("--envs", default="none,ynn_off,hugetlb,ynn_off+hugetlb",
                  help=f"comma list from {list(ENVS)}")
  ap.add_argument("--impls", default="einsum,cpu", help="model.attention_impl values")
  ap.add_argument("--remats", default="none", help="model.remat_policy values")
  ap.add_argument("--steps", type=int, default=8, help="timed rounds")
  ap.add_argument("--burst", type=int, default=3,
                  help="back-to-back steps per round and variant; the first is reported apart "
                  "(1: one step per round, which times the first step after idling)")
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--set", nargs="*", default=[], help="overrides like train.batch_size=8")
  ap.add_argument("--json", default=None)
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--impl", default="einsum", help=argparse.SUPPRESS)
  ap.add_argument("--remat", default="none", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    return worker(args)
  envs = args.envs.split(",")
  for e in envs:
    if e not in ENVS:
      ap.error(f"--envs: {e!r} is none of {list(ENVS)}")
    if ENVS[e].get("LD_PRELOAD") == "":  # would time glibc's malloc under mimalloc's name
      ap.error(f"--envs: {e!r} needs mimalloc (pip install cmeel-mimalloc), not installed")
  variants = [(e, i, r) for e in envs for i in args.impls.split(",")
              for r in args.remats.split(",")]
  procs, info = {}, {}
  for env_name, impl, remat in variants:  # compile one at a time
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "GLIBC_TUNABLES", "LD_PRELOAD", *runtime.MIMALLOC_ENV)}
    env.update(ENVS[env_name], MTP_JAX_CPU_DEFAULTS="0")
    cmd, env = common.module_command("bench_cpu_defaults", env)
    cmd += ["--worker", "--impl", impl, "--remat", remat,
            "--config", args.config, "--kind", args.kind, "--n_future", str(args.n_future),
            "--burst", str(args.burst),
            "--set", *args.set]
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info[(env_name, impl, remat)] = json.loads(p.stdout.readline())
    procs[(env_name, impl, remat)] = p
  times = {v: [] for v in variants}
  cpu_times = {v: [] for v in variants}
  first_times = {v: [] for v in variants}
  for i in range(args.warmup + args.steps):
    for v, p in procs.items():
      p.stdin.write("step\n")
      p.stdin.flush()
      s = json.loads(p.stdout.readline())
      if i >= args.warmup:
        times[v].append(s["s"])
        cpu_times[v].append(s["cpu_s"])
        first_times[v].append(s["first_s"])
  for p in procs.values():
    p.stdin.close()
    p.wait()
  med = {v: float(np.median(t)) for v, t in times.items()}
  # Other jobs on the cores slow whole rounds down (2x here): the speedup is the median over
  # rounds of (first variant's step / this variant's step) in the same round.
  first = np.asarray(times[variants[0]])
  speedup = {v: float(np.median(first / np.asarray(t))) for v, t in times.items()}
  records = [{"env": v[0], "attention_impl": v[1], "remat_policy": v[2], "env_vars": ENVS[v[0]],
              "step_seconds_median": med[v], "tokens_per_sec": info[v]["tokens"] / med[v],
              "speedup_vs_first": speedup[v],
              "cpu_seconds_median": float(np.median(cpu_times[v])),
              "step_seconds": times[v], "cpu_seconds": cpu_times[v], "burst": args.burst,
              "first_of_burst_seconds_median": float(np.median(first_times[v])),
              "compile_seconds": info[v]["compile_s"], "config": args.config,
              "kind": args.kind, "n_future": args.n_future} for v in variants]
  print("| env | attention_impl | remat | step s (median) | CPU s (median) | tokens/s | speedup |")
  print("|---|---|---|---|---|---|---|")
  for r in records:
    print(f"| {r['env']} | {r['attention_impl']} | {r['remat_policy']} | "
          f"{r['step_seconds_median']:.3f} | "
          f"{r['cpu_seconds_median']:.3f} | {r['tokens_per_sec']:,.0f} | "
          f"{r['speedup_vs_first']:.3f} |")
  common.write_json(records, args.json)


if __name__ == "__main__":
  main()
