"""Where a train step's time goes on one core of this machine, mtp_jax's op classes beside
PyTorch's (the seed design of experiments/torch_peer.py, the model bench_train --peer times).

    python experiments/profile_train.py [--n_future 1,4] [--kind projection] [--steps 3] \\
        [--reps 5] [--no_torch] [--json out/profile_train.json]

One core (`os.sched_setaffinity`, CPU 0, before JAX starts) and one thread per framework: XLA:CPU's
pool has one thread and runs every dot in line (`train.batch_slices=1`), so a thunk's event lasts
as long as its op and the ops' sum covers the step (`coverage`; with two threads, Eigen's
asynchronous dots end their events at dispatch: experiments/hlo_profile.py), and PyTorch runs
with `torch.set_num_threads(1)`. This is the frameworks' single-thread work, not their
threading (bench_train --peer measures that). The default config, AdamW, one random batch.

mtp_jax: the step timed untraced (`--reps` steps after a warm-up), then `--steps` steps under
`jax.profiler.trace`, each thunk matched to the step's optimised HLO (hlo_profile: attention
dot, dot = the weights', reduce, scatter, copy, loop = the loss's scan over heads, elementwise;
"(library)": YNNPACK / oneDNN fusions). PyTorch: `torch.profiler` self CPU time per aten op, in
classes: `dot` (mm, addmm, bmm, linear's), `attention` (scaled_dot_product_attention's kernels,
forward and backward: its softmax included, which mtp_jax's classes count as elementwise),
`optimizer` (every op inside AdamW's step, zero_grad and clip_grad_norm_; mtp_jax's optax update
is in its elementwise and reduce classes), `elementwise` (every other op). Milliseconds per
step; quote the shares and the same-run ratios, and name the machine (`machine` in the records).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX starts: the CPU defaults, then one thread for dots
  from experiments import common
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()
  common.one_core_before_jax()

import argparse
import collections
import json
import sys
import tempfile
import time

import jax
import numpy as np

from experiments import common, hlo_profile
from experiments.bench_train import setup

TORCH_CLASSES = (  # (class, aten op name pieces), first match wins
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("dot", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")),
)


def profile_jax(config_path: str, kind: str, n: int, steps: int, reps: int, top: int) -> dict:
  box = setup(config_path, kind, n, ["train.batch_slices=1"])
  step, state, batch = box["step"], box["state"], box["batch"]

  def run(k):
    nonlocal state
    t = time.perf_counter()
    for _ in range(k):
      state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    return (time.perf_counter() - t) / k
  run(2)
  seconds = float(np.median([run(1) for _ in range(reps)]))
  hlo = step.lower(state, batch).compile().as_text()
  comps = hlo_profile.computations(hlo)
  entry = hlo_profile.entry_name(hlo)
  ops = hlo_profile.classify(comps[entry], comps)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      traced = run(steps)
    total, count = hlo_profile.thunk_times(d)
  prof = hlo_profile.by_class(ops, total, count, top)
  return {"framework": "jax", "kind": kind, "n_future": n, "step_ms_untraced": seconds * 1e3,
          "traced_over_untraced": round(traced / seconds, 2),
          "coverage": round(prof["us_timed_ops"] / (traced * 1e6), 2),
          "ms_by_class": {k: round(v / 1e3, 1) for k, v in prof["us_by_class"].items()},
          "share_by_class": prof["share_by_class"], "ops_in_step": len(ops),
          "ops_timed": prof["ops_timed"], "top_ops": prof["top_ops"]}


def torch_class(event) -> str:
  """The class of a torch.profiler event: `optimizer` inside AdamW's step, zero_grad or
  clip_grad_norm_, else by its aten op's name (TORCH_CLASSES; `elementwise` if none)."""
  parent = event
  while parent is not None:
    if parent.name.startswith("Optimizer.") or "clip_grad" in parent.name:
      return "optimizer"
    parent = parent.cpu_parent
  for cls, pieces in TORCH_CLASSES:
    if any(p in event.name for p in pieces):
      return cls
  return "elementwise"


def profile_torch(config_path: str, n: int, steps: int, reps: int, top: int) -> dict:
  import torch
  from torch.profiler import ProfilerActivity, profile

  from experiments import torch_peer
  from experiments.bench_train import _peer_config
  step = torch_peer.make_peer(_peer_config(argparse.Namespace(config=config_path), [], n))[0]

  def run(k):
    t = time.perf_counter()
    for _ in range(k):
      step()
    return (time.perf_counter() - t) / k
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    run(2)
    seconds = float(np.median([run(1) for _ in range(reps)]))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
      traced = run(steps)
  finally:
    torch.set_num_threads(threads)
  by_op, sums, op_class = collections.defaultdict(float), collections.defaultdict(float), {}
  for e in prof.events():  # us per step of each op's own time, classed with its ancestors
    us = e.self_cpu_time_total / steps
    op_class[e.name] = cls = torch_class(e)  # the last event's class, per name
    by_op[e.name] += us
    sums[cls] += us
  all_us = sum(sums.values())
  order = sorted(sums.items(), key=lambda kv: -kv[1])
  rows = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
  return {"framework": "torch", "kind": "projection", "n_future": n,
          "step_ms_untraced": seconds * 1e3, "traced_over_untraced": round(traced / seconds, 2),
          "coverage": round(all_us / (traced * 1e6), 2),
          "ms_by_class": {k: round(v / 1e3, 1) for k, v in order},
          "share_by_class": {k: round(v / all_us, 3) for k, v in order},
          "top_ops": [{"op": k, "class": op_class[k], "us_per_step": round(v, 1)}
                      for k, v in rows], "torch_version": torch.__version__}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/default.py")
  p.add_argument("--n_future", default="1,4")
  p.add_argument("--kind", default="projection", help="mtp_jax's head kind (torch: projection)")
  p.add_argument("--steps", type=int, default=3, help="traced steps per variant")
  p.add_argument("--reps", type=int, default=5, help="untraced steps timed per variant")
  p.add_argument("--top", type=int, default=15, help="ops listed per record")
  p.add_argument("--no_torch", action="store_true", help="profile mtp_jax only")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  try:
    ns = [int(n) for n in args.n_future.split(",")]
  except ValueError:
    p.error(f"--n_future: comma-separated positive integers, got {args.n_future!r}")
  if min(ns) < 1 or args.steps < 1 or args.reps < 1:
    p.error("--n_future, --steps and --reps must be >= 1")
  records = []
  for n in ns:
    recs = [profile_jax(args.config, args.kind, n, args.steps, args.reps, args.top)]
    if not args.no_torch:
      recs.append(profile_torch(args.config, n, args.steps, args.reps, args.top))
    for rec in recs:
      rec.update(config=args.config, xla_flags=os.environ.get("XLA_FLAGS", ""))
      print(json.dumps({k: rec[k] for k in ("framework", "n_future", "step_ms_untraced",
                                            "coverage", "ms_by_class")}), flush=True)
    records += recs
  common.emit(records, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
