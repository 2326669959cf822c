"""The 72-case token-equality check of the decoding loops: the tokens every head kind decodes,
greedy and sampled, with chains and trees, pinned before a change to the decoder and compared
after it (a refactor of the cycle, such as driving the forward in two phases, must not change
one token).

    python experiments/token_equality.py --out DIR            # writes DIR/models.npz, tokens.json
    python experiments/token_equality.py --against DIR        # decodes DIR's models, compares

Cases: 3 head kinds (parallel, projection, sequential) x greedy / sampled (temperature 3, seed 3)
x 6 windows (chains of 2, 3, 4 heads; trees 2,1 and 3,2,1; dynamic:7) x 2 prompt sets (one
prompt; a ragged batch of 3) = 72, 16 new tokens, EOS ignored. Each kind's model is trained 150
steps on a cyclic sequence (tests/test_decode.py's), so drafts are accepted, and saved: --against
decodes the saved params, so a change to training cannot pass for one to decoding. Greedy cases
are also checked against plain greedy decoding (they must equal it). Sequential heads draft one
path, so their tree cases run the chain (with a logged reason), still compared.
Exit status 1 where a case differs (or a greedy case differs from plain decoding).
--smoke (both calls): parallel heads trained 3 steps, chain:2 and tree:2,1 on the ragged batch,
greedy and sampled: 4 cases, the suite's run of this script."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import jax
import numpy as np

from experiments import common
from mtp_jax import optimizer as optim_lib
from mtp_jax import sharding as shard_lib
from mtp_jax import steps as steps_lib
from mtp_jax.config import base_config
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.model import build_model, init_params

VOCAB, PAD, EOS = 16, 14, 15
CYCLE = [3, 7, 1, 9, 4, 12, 6, EOS]
KINDS = ("parallel", "projection", "sequential")
WINDOWS = (("chain:2", 2, None), ("chain:3", 3, None), ("chain:4", 4, None),
           ("tree:2,1", 3, "2,1"), ("tree:3,2,1", 4, "3,2,1"), ("dynamic:7", 4, "dynamic:7"))
PROMPTS = {"one": [[3, 7, 1]], "ragged": [[9], [4, 12, 6, 2, 3], [5, 5, 2, 11, 0, 8, 13, 10]]}
MODES = {"greedy": {}, "sampled": {"temperature": 3.0, "seed": 3}}  # hot: the draws vary
MAX_NEW = 16


def config(kind: str, n_future: int = 4):
  """The cycle models' config (tests/test_decode.py's too)."""
  c = base_config()
  c.model.update(vocab_size=VOCAB, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=64,
                 max_len=96, n_future=n_future)
  c.model.heads.kind = kind
  c.data.seq_len = 32
  c.train.batch_size = 8
  c.train.steps = 150
  c.optim.update(lr=1e-2, warmup_steps=10)
  return c


def cyclic_batch(rng, batch: int, seq_len: int):
  """`batch` windows of the cycle, each from a random start."""
  starts = rng.integers(0, len(CYCLE), size=batch)
  idx = (starts[:, None] + np.arange(seq_len)) % len(CYCLE)
  return {"tokens": np.asarray(CYCLE)[idx].astype(np.int32),
          "segment_ids": np.ones((batch, seq_len), np.int32)}


def train(kind: str, steps: int | None = None):
  """(args, params, head 1's accuracy at the last step): 150 steps (or `steps`) on the cycle
  (tests/test_decode.py's fixture too)."""
  c = config(kind)
  c.train.steps = steps or c.train.steps
  model = build_model(c)
  tx = optim_lib.make_optimizer(c)
  state = steps_lib.init_state(model, tx, c, shard_lib.make_mesh(c), jax.random.PRNGKey(0))
  step = jax.jit(steps_lib.make_train_step(model, tx, c), donate_argnums=0)
  rng = np.random.default_rng(0)
  for _ in range(c.train.steps):
    state, metrics = step(state, cyclic_batch(rng, c.train.batch_size, c.data.seq_len))
  return model.args, jax.device_get(state.params), float(metrics["head_acc"][0])


def load(kind: str, arrays):
  """(args, params) with the saved leaves of `kind` (the structure from a fresh init)."""
  model = build_model(config(kind))
  shapes = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
  return model.args, jax.tree_util.tree_map_with_path(
      lambda p, s: np.asarray(arrays[f"{kind}{jax.tree_util.keystr(p)}"], s.dtype), shapes)


def digest(r) -> str:
  return hashlib.sha256(np.asarray(r.lengths, np.int64).tobytes()
                        + np.asarray(r.tokens, np.int64).tobytes()).hexdigest()[:16]


def run(models: dict, windows=WINDOWS, prompt_sets=PROMPTS) -> tuple[dict, list[str]]:
  """({case: {"tokens": digest, "heads", "tree", "forwards"}}, greedy cases unequal to plain)."""
  out, wrong = {}, []
  for kind, (args, params) in models.items():
    for prompts_name, prompts in prompt_sets.items():
      kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD)
      plain = decode_lib.plain(params, args, prompts, **kw)
      for mode, sample_kw in MODES.items():
        for window, k, tree in windows:
          r = decode_lib.decode(params, args, prompts, k=k, tree=tree, **kw, **sample_kw)
          name = f"{kind}/{mode}/{window}/{prompts_name}"
          out[name] = {"tokens": digest(r), "heads": r.heads, "tree": r.tree,
                       "forwards": r.forwards}
          if mode == "greedy" and digest(r) != digest(plain):
            wrong.append(f"{name}: not plain greedy's tokens")
  return out, wrong


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  group = ap.add_mutually_exclusive_group(required=True)
  group.add_argument("--out", help="train the models, decode, write DIR/models.npz, tokens.json")
  group.add_argument("--against", help="decode DIR's models and compare with its tokens.json")
  ap.add_argument("--smoke", action="store_true",
                  help="4 cases on parallel heads trained 3 steps (give it to both calls)")
  a = ap.parse_args(argv)
  kinds, windows, prompt_sets, steps = KINDS, WINDOWS, PROMPTS, None
  if a.smoke:
    kinds, windows, prompt_sets, steps = ("parallel",), (WINDOWS[0], WINDOWS[3]), {
        "ragged": PROMPTS["ragged"]}, 3
  if a.out:
    models = {kind: train(kind, steps)[:2] for kind in kinds}
    os.makedirs(a.out, exist_ok=True)
    np.savez(os.path.join(a.out, "models.npz"), **{
        f"{kind}{jax.tree_util.keystr(p)}": np.asarray(x) for kind, (_, params) in models.items()
        for p, x in jax.tree_util.tree_leaves_with_path(params)})
  else:
    with np.load(os.path.join(a.against, "models.npz")) as arrays:
      models = {kind: load(kind, arrays) for kind in kinds}
  cases, wrong = run(models, windows, prompt_sets)
  if a.out:  # stamped with the machine that pinned them
    common.write_json({"cases": cases}, os.path.join(a.out, "tokens.json"), indent=1)
  else:
    with open(os.path.join(a.against, "tokens.json")) as f:
      pinned = json.load(f)["cases"]
    wrong += [f"{name}: {pinned.get(name)} -> {case}" for name, case in cases.items()
              if pinned.get(name) != case]
  print(f"{len(cases)} cases, {len(wrong)} wrong" + "".join(f"\n  {w}" for w in wrong))
  return 1 if wrong else 0


if __name__ == "__main__":
  sys.exit(main())
