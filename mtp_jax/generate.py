"""Decode from a trained workdir:

    python -m mtp_jax.generate --workdir DIR --prompt "def fib(" --max_new_tokens 256 \\
        --mode speculative --heads 4 [--temperature 0.8 --top_p 0.95 --top_k 0 \\
        --num_samples 4 --seed 0]

Several --prompt (or --prompt_file) flags decode as one batch; --num_samples copies of each
are rows of that batch (row i * num_samples + s is sample s of prompt i, seeded by (seed, row)).
--temperature 0 (the default) is greedy; > 0 samples (then top-k, then top-p), and speculative
mode is speculative sampling, distributed exactly as plain sampling from head 1. Prints each
completion and one line of figures: tokens, forwards, tokens per forward, seconds. `--mode both`
also runs plain decoding (head 1) and reports the speed-up; greedy, whether the outputs are
identical (they must be); sampled, the two modes' tokens per forward (their tokens differ).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (README, "CPU speed")
  from mtp_jax import runtime
  runtime.apply_cpu_defaults()

import os
import sys

import numpy as np
from absl import app, flags

from mtp_jax import cli
from mtp_jax import decode as decode_lib
from mtp_jax import sampling as sampling_lib
from mtp_jax.workdir import Loaded, load_workdir  # noqa: F401  (generate.load_workdir)


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


def check_flags(*, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                num_samples: int, seed: int) -> None:
  """Flag checks that need no workdir: one line naming the flag, before anything is loaded."""
  if max_new_tokens < 1:
    raise ValueError(f"--max_new_tokens: must be >= 1, got {max_new_tokens}")
  sampling_lib.check(temperature, top_k, top_p, seed)
  decode_lib.repeat([], num_samples)


def run(workdir: str, texts: list[str], *, max_new_tokens: int, mode: str, heads: int | None,
        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, num_samples: int = 1,
        seed: int = 0, out=sys.stdout) -> dict:
  check_flags(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
              num_samples=num_samples, seed=seed)
  loaded = load_workdir(workdir)
  args = loaded.model.args
  k = args.n_future if heads is None else heads
  decode_lib.check_heads(args, k)
  prompts = decode_lib.repeat(encode_prompts(loaded.tokenizer, texts), num_samples)
  tok = loaded.tokenizer
  kw = dict(max_new_tokens=max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
  results = {}
  if mode in ("greedy", "both"):
    results["greedy"] = decode_lib.greedy(loaded.params, args, prompts, **kw)
  if mode in ("speculative", "both"):
    results["speculative"] = decode_lib.decode(loaded.params, args, prompts, k=k, **kw)
  shown = results.get("speculative") or results["greedy"]
  for b, text in enumerate(texts):
    for i in range(num_samples):
      row = b * num_samples + i
      completion = tok.decode(shown.tokens[row, :shown.lengths[row]])
      sample = f", sample {i + 1}" if num_samples > 1 else ""
      print(f"--- prompt {b + 1}{sample}\n{text}{completion}", file=out)
  report = {"step": loaded.step, "heads": k, "temperature": temperature, "top_k": top_k,
            "top_p": top_p, "num_samples": num_samples, "seed": seed,
            "completions": [tok.decode(shown.tokens[r, :shown.lengths[r]])
                            for r in range(len(prompts))]}
  for name, r in results.items():  # sampled, "greedy" is plain sampling with head 1
    print(figures_line("plain" if name == "greedy" and temperature > 0 else name, r), file=out)
    report[name] = {"tokens": int(r.lengths.sum()), "forwards": r.forwards,
                    "tokens_per_forward": r.tokens_per_forward, "seconds": r.seconds}
  if mode == "both":
    g, s = results["greedy"], results["speculative"]
    report["speedup"] = g.seconds / max(s.seconds, 1e-9)
    accept = np.round(s.acceptance_by_position(), 3).tolist()
    if temperature == 0:
      report["identical"] = bool(np.array_equal(g.tokens, s.tokens)
                                 and np.array_equal(g.lengths, s.lengths))
      print(f"identical to greedy: {report['identical']}  speed-up {report['speedup']:.2f}x  "
            f"acceptance by draft position {accept}", file=out)
    else:  # sampled: the same distribution, not the same tokens
      print(f"sampled (temperature {temperature}): tokens/forward speculative "
            f"{s.tokens_per_forward:.2f} against plain {g.tokens_per_forward:.2f}  speed-up "
            f"{report['speedup']:.2f}x  acceptance by draft position {accept}", file=out)
  return report


FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "training workdir (config.json + checkpoints/)")
flags.DEFINE_multi_string("prompt", [], "prompt text; repeat for a batch")
flags.DEFINE_multi_string("prompt_file", [], "file whose whole text is one prompt; repeatable")
flags.DEFINE_integer("max_new_tokens", 256, "tokens to generate per prompt")
flags.DEFINE_enum("mode", "speculative", ["speculative", "greedy", "both"], "decoding mode")
flags.DEFINE_integer("heads", None, "heads used for drafting, 1..n_future (default: all)")
flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampling")
flags.DEFINE_integer("top_k", 0, "sample among the k most likely tokens (0: off)")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling: the most likely tokens of mass top_p (1: off)")
flags.DEFINE_integer("num_samples", 1, "samples per prompt (rows of one batch)")
flags.DEFINE_integer("seed", 0, "sampling seed (row b draws from (seed, b))")


def main(argv):
  del argv
  cli.quiet_logs()
  try:
    check_flags(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                top_k=FLAGS.top_k, top_p=FLAGS.top_p, num_samples=FLAGS.num_samples,
                seed=FLAGS.seed)
    if not FLAGS.workdir:
      raise ValueError("--workdir: required, a training workdir")
    texts = list(FLAGS.prompt)
    for path in FLAGS.prompt_file:
      if not os.path.isfile(path):
        raise ValueError(f"--prompt_file: {path!r} does not exist")
      with open(path, encoding="utf-8", errors="surrogateescape") as f:
        texts.append(f.read())
    run(FLAGS.workdir, texts, max_new_tokens=FLAGS.max_new_tokens, mode=FLAGS.mode,
        heads=FLAGS.heads, temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
        num_samples=FLAGS.num_samples, seed=FLAGS.seed)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
