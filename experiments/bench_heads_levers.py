"""What each lever of experiments/smollm2_heads.py buys a heads-only training step on SmolLM2-135M:
tokens per second of the train step (a) as train.py runs it (the frozen trunk forward in every
step, heads over the whole vocabulary), (b) on cached trunk states, (c) cached and over a draft
vocabulary of V' ids, per head kind; and of the trunk pass that (b) and (c) pay once per window.

    python experiments/bench_heads_levers.py --json experiments/results/bench_heads_levers.json
    python experiments/bench_heads_levers.py --gguf tiny.gguf --batch 2 --seq_len 32 --reps 1

Warm-up step first, then --reps timed steps each, variants interleaved round by round; ratios
are within one run. Random tokens (the cost does not depend on them). Prints JSON.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from mtp_jax import generate, optimizer, steps as steps_lib
from mtp_jax.convert import from_gguf, pretrained
from mtp_jax.model import build_model, trunk_states

KINDS = ("parallel", "projection", "sequential")


def bench_kind(wd: str, args) -> dict:
  L = generate.load_workdir(wd)
  c = L.config.copy_and_resolve_references()
  c.optim.trainable, c.train.batch_size, c.data.seq_len = "heads", args.batch, args.seq_len
  model, tx = build_model(c), optimizer.make_optimizer(c)
  a = model.args
  tok = np.random.default_rng(0).integers(0, a.vocab_size, (args.batch, args.seq_len), np.int32)
  seg = np.ones_like(tok)
  ids = np.arange(min(args.draft_vocab, a.vocab_size), dtype=np.int32)
  z_fn = jax.jit(lambda p, t: trunk_states(p, a, t))
  z = np.asarray(z_fn(L.params, tok))
  variants = {"every_step_trunk": ({"tokens": tok, "segment_ids": seg}, None),
              "cached_trunk": ({"tokens": tok, "segment_ids": seg, "trunk_states": z}, None),
              "cached_trunk_draft_vocab": ({"tokens": tok, "segment_ids": seg,
                                            "trunk_states": z}, ids)}
  runs = {}
  for name, (batch, d_ids) in variants.items():
    params = jax.tree.map(jnp.array, L.params)
    state = steps_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                 opt_state=tx.init(params))
    step = jax.jit(steps_lib.make_train_step(model, tx, c, d_ids), donate_argnums=0)
    state, _ = step(state, batch)  # compile and warm up
    jax.block_until_ready(state)
    runs[name] = [step, state, batch, []]
  trunk_s = []
  for _ in range(args.reps):
    t0 = time.perf_counter()
    jax.block_until_ready(z_fn(L.params, tok))
    trunk_s.append(time.perf_counter() - t0)
    for r in runs.values():
      t0 = time.perf_counter()
      r[1], _ = r[0](r[1], r[2])
      jax.block_until_ready(r[1])
      r[3].append(time.perf_counter() - t0)
  n = args.batch * args.seq_len
  rate = {k: round(n / float(np.median(r[3])), 1) for k, r in runs.items()}
  base = rate["every_step_trunk"]
  return {"kind": a.head_kind, "n_future": a.n_future, "tokens_per_step": n,
          "draft_vocab": len(ids), "trunk_pass_tokens_per_s": round(n / float(np.median(trunk_s)),
                                                                   1),
          "train_tokens_per_s": rate, "speedup": {k: round(v / base, 2) for k, v in rate.items()},
          "step_seconds": {k: [round(x, 3) for x in r[3]] for k, r in runs.items()}}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--gguf", default="", help="a Llama GGUF file (default: SmolLM2-135M's)")
  ap.add_argument("--kinds", default=",".join(KINDS))
  ap.add_argument("--n_future", type=int, default=4)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--draft_vocab", type=int, default=4096)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--json", default="")
  args = ap.parse_args(argv)
  gguf = args.gguf or pretrained.fetch("smollm2")
  records = []
  with tempfile.TemporaryDirectory() as tmp:
    for kind in args.kinds.split(","):
      wd = os.path.join(tmp, kind)
      from_gguf.import_gguf(gguf, wd, n_future=args.n_future, heads=kind)
      records.append({"model": os.path.basename(gguf), **bench_kind(wd, args)})
      print(f"{kind}: {records[-1]['train_tokens_per_s']}", file=sys.stderr, flush=True)
  common.emit(records, args.json or None)
  return 0


if __name__ == "__main__":
  sys.exit(main())
