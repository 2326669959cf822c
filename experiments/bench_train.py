"""Train-step time of MTP against next-token prediction at matched parameters (paper Table S5).

    python experiments/bench_train.py --json out/bench_train.json [--config configs/default.py]

For parallel heads with n_future in {1, 2, 4} (same n_layers, so the same parameter count) and
for sequential heads (n_future 4, extra depth modules), compiles the full train step (model,
per-head loss, gradients, AdamW) once, runs `--warmup` steps, then times `--steps` steps on one
random batch and reports the median. All variants run in this one process, interleaved round by
round, so machine noise hits them alike; quote the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from mtp_jax import commandline
from mtp_jax import optimizer as optim_lib
from mtp_jax import sharding as shard_lib
from mtp_jax import steps as steps_lib
from mtp_jax.config import load_file
from mtp_jax.model import build_model, param_count

VARIANTS = [("parallel", 1), ("parallel", 2), ("parallel", 4), ("sequential", 4),
            ("projection", 4)]


def setup(config_path, kind, n_future, overrides):
  c = load_file(config_path)
  c.model.heads.kind = kind
  c.model.n_future = n_future
  c.loss.head_weights = "deepseek" if kind == "sequential" else "uniform"
  for key, value in overrides.items():  # parsed by the field's type: "False" is False
    commandline.set_field(c, key, value)
  model = build_model(c)
  tx = optim_lib.make_optimizer(c)
  mesh = shard_lib.make_mesh(c)
  state = steps_lib.init_state(model, tx, c, mesh, jax.random.PRNGKey(0))
  step = jax.jit(steps_lib.make_train_step(model, tx, c), donate_argnums=0)
  rng = np.random.default_rng(0)
  B, S = c.train.batch_size, c.data.seq_len
  batch = {"tokens": rng.integers(0, 256, (B, S)).astype(np.int32),
           "segment_ids": np.ones((B, S), np.int32)}
  batch = jax.device_put(batch)
  t = time.perf_counter()
  state, m = step(state, batch)
  jax.block_until_ready(m)
  return {"step": step, "state": state, "batch": batch, "compile_s": time.perf_counter() - t,
          "n_params": param_count(state.params), "tokens": B * S, "config": c}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="configs/default.py")
  ap.add_argument("--json", default=None, help="write the records here")
  ap.add_argument("--steps", type=int, default=5, help="timed steps per variant")
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--set", nargs="*", default=[], help="overrides like train.batch_size=8")
  args = ap.parse_args()
  bad = [kv for kv in args.set if "=" not in kv]
  if bad:
    ap.error(f"--set: expected KEY=VALUE, got {bad[0]!r}")
  overrides = dict(kv.split("=", 1) for kv in args.set)
  try:
    for key, value in overrides.items():  # bad input fails here, before any compile
      commandline.set_field(load_file(args.config), key, value)
  except ValueError as e:
    ap.error(f"--set: {e}")
  runs = {v: setup(args.config, *v, overrides) for v in VARIANTS}
  for _ in range(args.warmup):
    for r in runs.values():
      r["state"], m = r["step"](r["state"], r["batch"])
      jax.block_until_ready(m)
  times = {v: [] for v in VARIANTS}
  for _ in range(args.steps):  # interleaved: noise hits every variant alike
    for v, r in runs.items():
      t = time.perf_counter()
      r["state"], m = r["step"](r["state"], r["batch"])
      jax.block_until_ready(m)
      times[v].append(time.perf_counter() - t)
  base = float(np.median(times[("parallel", 1)]))
  records = []
  for (kind, n), r in runs.items():
    med = float(np.median(times[(kind, n)]))
    records.append({"kind": kind, "n_future": n, "step_seconds_median": med,
                    "ratio_to_ntp": med / base, "n_params": r["n_params"],
                    "tokens_per_sec": r["tokens"] / med, "compile_seconds": r["compile_s"],
                    "batch": r["config"].train.batch_size, "seq_len": r["config"].data.seq_len,
                    "d_model": r["config"].model.d_model, "n_layers": r["config"].model.n_layers,
                    "backend": jax.devices()[0].platform})
  print("| kind | n_future | params | step s (median) | ratio to n=1 | tokens/s |")
  print("|---|---|---|---|---|---|")
  for rec in records:
    print(f"| {rec['kind']} | {rec['n_future']} | {rec['n_params']:,} | "
          f"{rec['step_seconds_median']:.3f} | {rec['ratio_to_ntp']:.3f} | "
          f"{rec['tokens_per_sec']:,.0f} |")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(records, f, indent=2)


if __name__ == "__main__":
  main()
