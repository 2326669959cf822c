"""Decode from a trained workdir:

    python -m mtp_jax.generate --workdir DIR --prompt "def fib(" --max_new_tokens 256 \\
        --mode speculative --heads 4 [--tree 4,2,1] [--temperature 0.8 --top_p 0.95 --top_k 0 \\
        --num_samples 4 --seed 0]

Several --prompt (or --prompt_file) flags decode as one batch; --num_samples copies of each
are rows of that batch (row i * num_samples + s is sample s of prompt i, seeded by (seed, row)).
--temperature 0 (the default) is greedy; > 0 samples (then top-k, then top-p), and speculative
mode is speculative sampling, distributed exactly as plain sampling from head 1. --heads auto
picks the k of highest predicted speed-up for this batch (plain decoding where speculation
would lose), and keeps what it measured in $MTP_JAX_CACHE/timings (~/.cache/mtp_jax/timings;
MTP_JAX_CACHE=off: nowhere), so a later call on this machine and model decides at once;
--tree SPEC|dynamic:N|auto drafts a tree (docs/decoding.md). Prints each completion and one
line of figures: tokens, forwards, tokens per forward, seconds. `--mode both` also runs plain
decoding (head 1), times each mode after its own warm-up --reps times, and reports the median
speed-up with its noise band ("about the same" when the band holds 1); greedy, whether the
outputs are identical (they must be); sampled, both modes' samples, labelled (their tokens
differ; the distribution is the same).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import os
import sys

import numpy as np
from absl import app, flags

from mtp_jax import cli
from mtp_jax import distributed
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.decoding import sampling as sampling_lib
from mtp_jax.decoding import speed, timing_cache
from mtp_jax.workdir import Loaded, load_workdir  # noqa: F401  (generate.load_workdir)


def encode_prompts(tokenizer, texts: list[str]) -> list[np.ndarray]:
  if not texts:
    raise ValueError("--prompt: give at least one --prompt or --prompt_file")
  out = []
  for i, text in enumerate(texts):
    if not text:
      raise ValueError(f"--prompt: prompt {i + 1} is empty")
    try:
      # bos first where the tokenizer's own template puts it (a Llama 3 tokenizer.json)
      ids = tokenizer.encode(text, add_bos=getattr(tokenizer, "prompt_bos", False))
    except ValueError as e:
      raise ValueError(f"--prompt: prompt {i + 1} cannot be encoded: {e}") from None
    out.append(ids)
  return out


def figures_line(name: str, r: decode_lib.DecodeResult) -> str:
  tokens = int(r.lengths.sum())
  return (f"{name}: tokens {tokens} forwards {r.forwards} tokens/forward "
          f"{r.tokens_per_forward:.2f} seconds {r.seconds:.3f} (compile {r.compile_seconds:.1f})")


def parse_heads(heads) -> int | str | None:
  """--heads: None (all), an integer or "auto"; one line naming the flag."""
  if heads is None or heads == "auto" or isinstance(heads, int):
    return heads
  try:
    return int(heads)
  except ValueError:
    raise ValueError(f"--heads: an integer 1..n_future or auto, got {heads!r}") from None


def check_flags(*, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                num_samples: int, seed: int, reps: int = speed.REPS) -> None:
  """Flag checks that need no workdir: one line naming the flag, before anything is loaded."""
  if max_new_tokens < 1:
    raise ValueError(f"--max_new_tokens: must be >= 1, got {max_new_tokens}")
  sampling_lib.check(temperature, top_k, top_p, seed)
  decode_lib.repeat([], num_samples)
  if reps < speed.REPS:
    raise ValueError(f"--reps: at least {speed.REPS} timed calls per mode, got {reps}")


def run(workdir: str, texts: list[str], *, max_new_tokens: int, mode: str, heads=None,
        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, num_samples: int = 1,
        seed: int = 0, tree=None, reps: int = speed.REPS, out=sys.stdout) -> dict:
  check_flags(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
              num_samples=num_samples, seed=seed, reps=reps)
  heads = parse_heads(heads)
  loaded = load_workdir(workdir)
  args = loaded.model.args
  prompts = decode_lib.repeat(encode_prompts(loaded.tokenizer, texts), num_samples)
  tok = loaded.tokenizer
  kw = dict(eos_id=tok.eos_id, pad_id=tok.pad_id, temperature=temperature, top_k=top_k,
            top_p=top_p, seed=seed)
  shape = dict(batch=len(prompts), prompt_len=max(len(p) for p in prompts),
               max_new_tokens=max_new_tokens, sampling=temperature > 0)
  runs = {}
  if mode in ("greedy", "both"):
    plain = decode_lib.Decoder(loaded.params, args, k=1, **shape)
    runs["greedy"] = lambda: plain(prompts, **kw)
  auto = None
  if mode in ("speculative", "both"):
    k, tree_, auto = decode_lib.resolve(loaded.params, args, prompts, disk=timing_cache.default(),
                                        max_new_tokens=max_new_tokens, k=heads, tree=tree, **kw)
    spec = decode_lib.Decoder(loaded.params, args, k=k, tree=tree_, **shape)
    runs["speculative"] = lambda: spec(prompts, **kw)
  if mode == "both":  # each mode warmed up, then timed `reps` times, interleaved
    timed = speed.time_modes(runs, reps)
    results = {name: t["result"] for name, t in timed.items()}
  else:
    results = {name: fn() for name, fn in runs.items()}
  names = {"greedy": "plain" if temperature > 0 else "greedy", "speculative": "speculative"}
  shown = list(results) if temperature > 0 else [next(reversed(results))]
  for b, text in enumerate(texts):
    for i in range(num_samples):
      row = b * num_samples + i
      sample = f", sample {i + 1}" if num_samples > 1 else ""
      for name in shown:
        r = results[name]
        label = f" ({names[name]} sampling)" if len(shown) > 1 else ""
        completion = tok.decode(r.tokens[row, :r.lengths[row]])
        print(f"--- prompt {b + 1}{sample}{label}\n{text}{completion}", file=out)
  last = results[next(reversed(results))]
  report = {"step": loaded.step, "heads": last.heads, "tree": last.tree,
            "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "num_samples": num_samples, "seed": seed,
            "completions": [tok.decode(last.tokens[r, :last.lengths[r]])
                            for r in range(len(prompts))]}
  if auto is not None:
    report["auto"] = auto
    cached = (f"its probe and timings {auto['measured_seconds']:.1f}s, kept in {auto['cache']}"
              if auto["measured_seconds"] else f"read from {auto['cache']}") if auto["cache"] \
        else f"its probe and timings {auto['measured_seconds']:.1f}s"
    print(f"auto: heads {auto['heads']}, tree {auto['tree'] or 'none (a chain)'}, predicted "
          f"speed-up {auto['S_predicted']:.2f}x (a {auto['a_predicted']:.2f}"
          + (f", chosen on {auto['S_chosen']:.2f}x" if auto.get("S_chosen") else "")
          + f"; deciding took "
          f"{auto['seconds']:.1f}s: {cached})", file=out)
  for name, r in results.items():  # sampled, "greedy" is plain sampling with head 1
    print(figures_line(names[name], r), file=out)
    report[name] = {"tokens": int(r.lengths.sum()), "forwards": r.forwards,
                    "tokens_per_forward": r.tokens_per_forward, "seconds": r.seconds}
    if temperature > 0:
      report[name]["completions"] = [tok.decode(r.tokens[i, :r.lengths[i]])
                                     for i in range(len(prompts))]
  if mode == "both":
    g, s = results["greedy"], results["speculative"]
    cmp = speed.compare(timed["greedy"]["seconds"], timed["speculative"]["seconds"])
    report.update(speedup=cmp["speedup"], speedup_band=cmp["band"], verdict=cmp["verdict"],
                  timing=cmp)
    accept = np.round(s.acceptance_by_position(), 3).tolist()
    what = "plain sampling" if temperature > 0 else "greedy decoding"
    if temperature == 0:
      report["identical"] = bool(np.array_equal(g.tokens, s.tokens)
                                 and np.array_equal(g.lengths, s.lengths))
      print(f"identical to greedy: {report['identical']}  {speed.line(cmp, what)}  "
            f"acceptance by draft position {accept}", file=out)
    else:  # sampled: the same distribution, not the same tokens
      print(f"sampled (temperature {temperature}): tokens/forward speculative "
            f"{s.tokens_per_forward:.2f} against plain {g.tokens_per_forward:.2f}  "
            f"{speed.line(cmp, what)}  acceptance by draft position {accept}", file=out)
  return report


FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "training workdir (config.json + checkpoints/)")
flags.DEFINE_multi_string("prompt", [], "prompt text; repeat for a batch")
flags.DEFINE_multi_string("prompt_file", [], "file whose whole text is one prompt; repeatable")
flags.DEFINE_integer("max_new_tokens", 256, "tokens to generate per prompt")
flags.DEFINE_enum("mode", "speculative", ["speculative", "greedy", "both"], "decoding mode")
flags.DEFINE_string("heads", None, "heads used for drafting, 1..n_future (default: all), or "
                    "auto: the k of highest predicted speed-up for this batch on this machine")
flags.DEFINE_string("tree", None, "draft tree SPEC (e.g. 4,2,1: top-4 of head 2, top-2 of head "
                    "3 under each, top-1 of head 4), dynamic:N (N nodes, the most likely paths, "
                    "chosen per cycle) or auto; greedy or sampled, parallel/projection heads")
flags.DEFINE_integer("reps", speed.REPS, "--mode both: timed calls per mode (>= 3), after a "
                     "warm-up each")
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
                seed=FLAGS.seed, reps=FLAGS.reps)
    parse_heads(FLAGS.heads)
    distributed.refuse_multiprocess("python -m mtp_jax.generate")
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
        num_samples=FLAGS.num_samples, seed=FLAGS.seed, tree=FLAGS.tree, reps=FLAGS.reps)
  except ValueError as e:
    print(f"error: {cli.flag_error(e)}", file=sys.stderr)  # the library's errors by flag
    sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
