"""Heads-only fine-tuning against full fine-tuning: train-step time of `optim.trainable =
"heads"` (frozen trunk behind lax.stop_gradient: no trunk backward, head 1's loss forward only)
over `trainable = "all"` on one imported-shape model.

    python experiments/bench_finetune.py --json experiments/results/bench_finetune.json

The model has the shape of a Llama import with 4 parallel heads (convert from-hf: d_model 512,
13 layers + 3 new head blocks = n_layers 16, vocab 32000, remat "full" as configs/finetune.py
sets), a small batch so it fits a 2-core CPU. Both steps are compiled once, warmed up, then timed
back to back, round after round (interleaved, so machine load hits both alike); the figure is the
median of the per-round ratios `heads_over_all_step`. Compiled FLOPs and temp memory of both
steps are recorded too (the FLOP count sees a scan body once: compare only between the two).
"""

from __future__ import annotations

import argparse
import os
import time

from mtp_jax.backends.cpu import runtime

if __name__ == "__main__":  # before jax starts: XLA flags, malloc huge pages (README)
  runtime.apply_cpu_defaults()

import jax
import numpy as np

from experiments import common
from mtp_jax import config as config_lib
from mtp_jax.config import validation
from mtp_jax import heads as heads_lib
from mtp_jax import steps as steps_lib
from mtp_jax.model import param_count


def make_config(args, trainable: str):
  c = config_lib.base_config()
  m = c.model
  m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = 32000, args.d_model, \
      args.n_layers, 8, 8
  m.d_ff, m.max_len, m.n_future, m.heads.kind = args.d_ff, args.seq_len, 4, args.kind
  m.remat_policy = "full"
  c.data.seq_len, c.train.batch_size = args.seq_len, args.batch_size
  c.optim.trainable, c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay = \
      trainable, 1e-3, 0, 0.0
  return validation.resolve(c)


def build(c):
  training = steps_lib.build_training(c)
  state = training.init_state(0)
  batch = jax.device_put(common.random_batch(c))
  t = time.perf_counter()
  compiled = training.step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t
  cost = compiled.cost_analysis() or {}
  box = {"state": state}

  def run():
    t = time.perf_counter()
    box["state"], m = compiled(box["state"], batch)
    jax.block_until_ready(m)
    return time.perf_counter() - t

  info = {"compile_s": compile_s, "flops": cost.get("flops"),
          "temp_bytes": common.memory_record(compiled)["temp_bytes"],
          "n_params": param_count(state.params)}
  return run, info


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", default="")
  p.add_argument("--kind", default="parallel", choices=("parallel", "projection", "sequential"))
  p.add_argument("--d_model", type=int, default=512)
  p.add_argument("--n_layers", type=int, default=16)
  p.add_argument("--d_ff", type=int, default=1408)
  p.add_argument("--batch_size", type=int, default=2)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--rounds", type=int, default=5)
  args = p.parse_args(argv)
  load_before = os.getloadavg()
  runs, infos = {}, {}
  for name in ("heads", "all"):
    runs[name], infos[name] = build(make_config(args, name))
  for _ in range(args.warmup):
    for name in runs:
      runs[name]()
  times = {name: [] for name in runs}
  for _ in range(args.rounds):
    for name in runs:
      times[name].append(runs[name]())
  ratios = [h / a for h, a in zip(times["heads"], times["all"])]
  out = {
      "heads_over_all_step": float(np.median(ratios)),
      "ratio_per_round": ratios,
      "median_step_s": {k: float(np.median(v)) for k, v in times.items()},
      "heads_over_all_flops": (infos["heads"]["flops"] / infos["all"]["flops"]
                               if infos["heads"]["flops"] and infos["all"]["flops"] else None),
      "compiled": infos,
      "model": {"kind": args.kind, "d_model": args.d_model, "n_layers": args.n_layers,
                "n_trunk": heads_lib.KINDS[args.kind].n_trunk(make_config(args, "all").model),
                "d_ff": args.d_ff, "n_future": 4, "vocab_size": 32000, "remat_policy": "full"},
      "batch": {"batch_size": args.batch_size, "seq_len": args.seq_len},
      "warmup": args.warmup, "rounds": args.rounds,
      "machine": dict(common.machine_info(), load_avg_1min_before=load_before[0],
                      load_avg_1min_after=os.getloadavg()[0], jax=jax.__version__),
  }
  common.emit(out, args.json, indent=1)


if __name__ == "__main__":
  main()
