"""Decode from a trained workdir:

    python -m mtp_jax.generate --workdir DIR --prompt "def fib(" --max_new_tokens 256 \\
        --mode speculative --heads 4

Several --prompt (or --prompt_file) flags decode as one batch. Prints each completion and one
line of figures: tokens, forwards, tokens per forward, seconds. `--mode both` also runs greedy
and says whether the outputs are identical and what the speed-up is.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import ml_collections
import numpy as np
from absl import app, flags

from mtp_jax import cli
from mtp_jax import config as config_lib
from mtp_jax import decode as decode_lib
from mtp_jax import optimizer as optim_lib
from mtp_jax import sharding as shard_lib
from mtp_jax import steps as steps_lib
from mtp_jax.checkpoint import Checkpointer
from mtp_jax.data import tokenizers
from mtp_jax.model import build_model


@dataclasses.dataclass
class Loaded:
  config: ml_collections.ConfigDict
  model: object
  params: object
  tokenizer: object
  step: int


def load_workdir(workdir: str) -> Loaded:
  """Config, model, params (latest good checkpoint) and tokenizer of a training workdir, or of
  one written by `mtp_jax.convert` (its checkpoint holds the params alone)."""
  cfg_path = os.path.join(workdir, "config.json")
  if not os.path.isfile(cfg_path):
    raise ValueError(f"--workdir: {workdir!r} has no config.json; train into it first with "
                     f"python -m mtp_jax.train --workdir {workdir}")
  config = config_lib.validate(config_lib.load_json(cfg_path))
  model = build_model(config)
  tx = optim_lib.make_optimizer(config)
  mesh = shard_lib.make_mesh(config)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.train.keep_checkpoints,
                      async_save=False)
  try:
    target = steps_lib.abstract_state(model, tx, config, mesh)
    if ckpt.saved_keys() == {"params"}:  # imported by mtp_jax.convert: no optimizer state
      target = {"params": target.params}
    restored = ckpt.restore_latest(target)
  finally:
    ckpt.close()
  if restored is None:
    raise ValueError(f"--workdir: {workdir!r} has no checkpoint in checkpoints/")
  state, step = restored
  params = state["params"] if isinstance(state, dict) else state.params
  return Loaded(config, model, params, tokenizers.get_tokenizer(config.data), step)


def encode_prompts(tokenizer, texts: list[str]) -> list[np.ndarray]:
  if not texts:
    raise ValueError("--prompt: give at least one --prompt or --prompt_file")
  out = []
  for i, text in enumerate(texts):
    if not text:
      raise ValueError(f"--prompt: prompt {i + 1} is empty")
    try:
      ids = tokenizer.encode(text)
    except ValueError as e:
      raise ValueError(f"--prompt: prompt {i + 1} cannot be encoded: {e}") from None
    out.append(ids)
  return out


def figures_line(name: str, r: decode_lib.DecodeResult) -> str:
  tokens = int(r.lengths.sum())
  return (f"{name}: tokens {tokens} forwards {r.forwards} tokens/forward "
          f"{r.tokens_per_forward:.2f} seconds {r.seconds:.3f} (compile {r.compile_seconds:.1f})")


def run(workdir: str, texts: list[str], *, max_new_tokens: int, mode: str, heads: int | None,
        out=sys.stdout) -> dict:
  loaded = load_workdir(workdir)
  args = loaded.model.args
  k = args.n_future if heads is None else heads
  decode_lib.check_heads(args, k)
  prompts = encode_prompts(loaded.tokenizer, texts)
  tok = loaded.tokenizer
  kw = dict(max_new_tokens=max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id)
  results = {}
  if mode in ("greedy", "both"):
    results["greedy"] = decode_lib.greedy(loaded.params, args, prompts, **kw)
  if mode in ("speculative", "both"):
    results["speculative"] = decode_lib.decode(loaded.params, args, prompts, k=k, **kw)
  shown = results.get("speculative") or results["greedy"]
  for b, text in enumerate(texts):
    completion = tok.decode(shown.tokens[b, :shown.lengths[b]])
    print(f"--- prompt {b + 1}\n{text}{completion}", file=out)
  report = {"step": loaded.step, "heads": k}
  for name, r in results.items():
    print(figures_line(name, r), file=out)
    report[name] = {"tokens": int(r.lengths.sum()), "forwards": r.forwards,
                    "tokens_per_forward": r.tokens_per_forward, "seconds": r.seconds}
  if mode == "both":
    g, s = results["greedy"], results["speculative"]
    report["identical"] = bool(np.array_equal(g.tokens, s.tokens)
                               and np.array_equal(g.lengths, s.lengths))
    report["speedup"] = g.seconds / max(s.seconds, 1e-9)
    print(f"identical to greedy: {report['identical']}  speed-up {report['speedup']:.2f}x  "
          f"acceptance by draft position {np.round(s.acceptance_by_position(), 3).tolist()}",
          file=out)
  return report


FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "training workdir (config.json + checkpoints/)")
flags.DEFINE_multi_string("prompt", [], "prompt text; repeat for a batch")
flags.DEFINE_multi_string("prompt_file", [], "file whose whole text is one prompt; repeatable")
flags.DEFINE_integer("max_new_tokens", 256, "tokens to generate per prompt")
flags.DEFINE_enum("mode", "speculative", ["speculative", "greedy", "both"], "decoding mode")
flags.DEFINE_integer("heads", None, "heads used for drafting, 1..n_future (default: all)")


def main(argv):
  del argv
  cli.quiet_logs()
  try:
    if not FLAGS.workdir:
      raise ValueError("--workdir: required, a training workdir")
    texts = list(FLAGS.prompt)
    for path in FLAGS.prompt_file:
      if not os.path.isfile(path):
        raise ValueError(f"--prompt_file: {path!r} does not exist")
      with open(path, encoding="utf-8", errors="surrogateescape") as f:
        texts.append(f.read())
    run(FLAGS.workdir, texts, max_new_tokens=FLAGS.max_new_tokens, mode=FLAGS.mode,
        heads=FLAGS.heads)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
