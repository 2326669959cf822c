"""Train-step time of MTP against next-token prediction at matched parameters (paper Table S5).

    python experiments/bench_train.py --json out/bench_train.json [--config configs/default.py]
    python experiments/bench_train.py --peer --json experiments/results/bench_train_peer.json

For parallel heads with n_future in {1, 2, 4} (same n_layers, so the same parameter count) and
for sequential heads (n_future 4, extra depth modules), compiles the full train step (model,
per-head loss, gradients, AdamW) once, runs `--warmup` steps, then times `--steps` steps on one
random batch and reports the median. All variants run in this one process, interleaved round by
round, so machine noise hits them alike; quote the ratios, not the seconds.

`--peer` times the seed document's design in PyTorch (experiments/torch_peer.py: Llama trunk,
projection heads sharing one unembedding, its per-head loss, AdamW) against the same model in
mtp_jax (heads.kind = "projection") for n_future 1 and 4, the two frameworks' steps interleaved
in this one process, and reports both tokens/s and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from mtp_jax import runtime

if __name__ == "__main__":  # before jax starts: XLA flags, malloc huge pages (README)
  runtime.apply_cpu_defaults()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtp_jax import cli  # noqa: E402
from mtp_jax import optimizer as optim_lib  # noqa: E402
from mtp_jax import sharding as shard_lib  # noqa: E402
from mtp_jax import steps as steps_lib  # noqa: E402
from mtp_jax.config import load_file  # noqa: E402
from mtp_jax.model import build_model, param_count  # noqa: E402

VARIANTS = [("parallel", 1), ("parallel", 2), ("parallel", 4), ("sequential", 4),
            ("projection", 4)]


def setup(config_path, kind, n_future, overrides):
  c = load_file(config_path)
  c.model.heads.kind = kind
  c.model.n_future = n_future
  c.loss.head_weights = "deepseek" if kind == "sequential" else "uniform"
  for key, value in overrides.items():  # parsed by the field's type: "False" is False
    cli.set_field(c, key, value)
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


def jax_run(c):
  """The compiled train step of config `c` on one random batch, compiled and run once."""
  model = build_model(c)
  tx = optim_lib.make_optimizer(c)
  state = steps_lib.init_state(model, tx, c, shard_lib.make_mesh(c), jax.random.PRNGKey(0))
  step = jax.jit(steps_lib.make_train_step(model, tx, c), donate_argnums=0)
  B, S = c.train.batch_size, c.data.seq_len
  tokens = np.random.default_rng(0).integers(0, 256, (B, S)).astype(np.int32)
  batch = jax.device_put({"tokens": tokens, "segment_ids": np.ones((B, S), np.int32)})
  box = {"state": state}

  def run():
    box["state"], m = step(box["state"], batch)
    return float(jax.block_until_ready(m["loss"]))
  t = time.perf_counter()
  run()
  return run, B * S, param_count(state.params), time.perf_counter() - t


def peer(args, overrides):
  """JAX projection heads against the PyTorch seed design, n_future 1 and 4, interleaved."""
  import torch  # noqa: PLC0415  (only --peer needs it)
  import torch_peer  # noqa: PLC0415

  runs = {}
  for n in (1, 4):
    c = load_file(args.config)
    c.model.heads.kind, c.model.n_future, c.loss.head_weights = "projection", n, "uniform"
    for key, value in overrides.items():
      section, field = key.rsplit(".", 1)
      node = c
      for part in section.split("."):
        node = getattr(node, part)
      old = getattr(node, field)
      setattr(node, field, value.lower() in ("1", "true") if isinstance(old, bool)
              else type(old)(value))
    runs[("jax", n)] = jax_run(c)
    t = time.perf_counter()
    step, tokens, n_params = torch_peer.make_peer(c)
    step()
    runs[("torch", n)] = (step, tokens, n_params, time.perf_counter() - t)
  for _ in range(args.warmup):
    for r in runs.values():
      r[0]()
  times = {v: [] for v in runs}
  for _ in range(args.steps):  # interleaved: both frameworks share the machine's noise
    for v, r in runs.items():
      t = time.perf_counter()
      r[0]()
      times[v].append(time.perf_counter() - t)
  med = {v: float(np.median(t)) for v, t in times.items()}
  records = []
  for n in (1, 4):
    rec = {"n_future": n, "kind": "projection", "config": args.config, "overrides": overrides,
           "batch": c.train.batch_size, "seq_len": c.data.seq_len, "d_model": c.model.d_model,
           "n_layers": c.model.n_layers, "n_heads": c.model.n_heads,
           "n_kv_heads": c.model.n_kv_heads, "d_ff": c.model.d_ff, "dtype": c.model.dtype,
           "attention_impl": c.model.attention_impl, "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
           "jax_version": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "steps": args.steps}
    for fw in ("jax", "torch"):
      rec[f"{fw}_step_seconds_median"] = med[(fw, n)]
      rec[f"{fw}_tokens_per_sec"] = runs[(fw, n)][1] / med[(fw, n)]
      rec[f"{fw}_n_params"] = runs[(fw, n)][2]
      rec[f"{fw}_first_step_seconds"] = runs[(fw, n)][3]
      rec[f"{fw}_step_seconds"] = times[(fw, n)]
    rec["jax_over_torch_tokens_per_sec"] = med[("torch", n)] / med[("jax", n)]
    records.append(rec)
  print("| n_future | params jax / torch | jax tokens/s | torch tokens/s | jax / torch |")
  print("|---|---|---|---|---|")
  for r in records:
    print(f"| {r['n_future']} | {r['jax_n_params']:,} / {r['torch_n_params']:,} | "
          f"{r['jax_tokens_per_sec']:,.0f} | {r['torch_tokens_per_sec']:,.0f} | "
          f"{r['jax_over_torch_tokens_per_sec']:.2f}x |")
  return records


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="configs/default.py")
  ap.add_argument("--json", default=None, help="write the records here")
  ap.add_argument("--steps", type=int, default=5, help="timed steps per variant")
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--set", nargs="*", default=[], help="overrides like train.batch_size=8")
  ap.add_argument("--peer", action="store_true",
                  help="time the PyTorch seed design against mtp_jax, n_future 1 and 4")
  args = ap.parse_args()
  bad = [kv for kv in args.set if "=" not in kv]
  if bad:
    ap.error(f"--set: expected KEY=VALUE, got {bad[0]!r}")
  overrides = dict(kv.split("=", 1) for kv in args.set)
  try:
    for key, value in overrides.items():  # bad input fails here, before any compile
      cli.set_field(load_file(args.config), key, value)
  except ValueError as e:
    ap.error(f"--set: {e}")
  if args.peer:
    records = peer(args, overrides)
    if args.json:
      os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
      with open(args.json, "w") as f:
        json.dump(records, f, indent=2)
    return
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
