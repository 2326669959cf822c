"""Which XLA:CPU compile options decode fastest on this machine: the greedy (or k-head) decoding
program (`decode.Decoder`) compiled once per option set in this one process, calls interleaved.

    python experiments/bench_decode_options.py --workdir runs/demo --batches 1,2,8 \\
        [--heads 1] [--options eigen,ynn] [--rounds 12] [--json out/bench_decode_options.json]

Option sets: `eigen` (the process's XLA_FLAGS alone: under the CPU defaults, Eigen's dots and
YNNPACK's reductions), `ynn` (YNNPACK's dots back, jaxlib's own list:
runtime.DECODE_YNN_FUSIONS), `xla` (no YNNPACK at all). The first is the baseline: each other's
speed over it is the median of same-round ratios, with quartiles. Every set must give the same
tokens. `rule` in each record names the set `runtime.decode_compiler_options` picks for the
batch on this CPU (the CLIs' choice, `runtime.YNN_ONE_ROW_CPUS` at one row), so a run here
tells whether that choice holds on this CPU. Random prompts of --prompt_len tokens; EOS is
ignored (fixed work).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import json
import os
import sys
import time

import numpy as np

from experiments import common
from mtp_jax.backends.cpu import runtime
from mtp_jax.decoding import decode as decode_lib

OPTION_SETS = {"eigen": None, "ynn": {runtime.YNN_FUSION_OPTION: runtime.DECODE_YNN_FUSIONS},
               "xla": {runtime.YNN_FUSION_OPTION: ""}}


def bench_batch(loaded, batch: int, heads: int, names: list[str], prompt_len: int,
                max_new: int, rounds: int) -> dict:
  rng = np.random.default_rng(batch)
  vocab = min(loaded.model.args.vocab_size, 256)
  prompts = [rng.integers(3, vocab, size=prompt_len).tolist() for _ in range(batch)]
  decoders = {n: decode_lib.Decoder(loaded.params, loaded.model.args, k=heads, batch=batch,
                                    prompt_len=prompt_len, max_new_tokens=max_new,
                                    compiler_options=OPTION_SETS[n]) for n in names}
  call = lambda n: decoders[n](prompts, eos_id=-1, pad_id=loaded.tokenizer.pad_id)
  tokens = {n: np.asarray(call(n).tokens) for n in names}  # also the warm-up
  seconds = {n: [] for n in names}
  for r in range(rounds):
    for n in common.rotated(names, r):
      t0 = time.perf_counter()
      call(n)  # returns host arrays: the call is done
      seconds[n].append(time.perf_counter() - t0)
  rule = runtime.decode_compiler_options(batch)
  base = names[0]
  rec = {"batch": batch, "heads": heads, "prompt_len": prompt_len, "max_new_tokens": max_new,
         "rounds": rounds, "baseline": base,
         "rule": next((n for n, o in OPTION_SETS.items() if o == rule), json.dumps(rule)),
         "tokens_equal": all(np.array_equal(tokens[n], tokens[base]) for n in names),
         "ms_median": {n: round(1e3 * float(np.median(s)), 3) for n, s in seconds.items()},
         "seconds": seconds, "speed_over_baseline": {}}
  for n in names[1:]:
    median, quartiles = common.same_round(seconds[base], seconds[n])
    rec["speed_over_baseline"][n] = {"median": round(median, 3),
                                     "quartiles": [round(q, 3) for q in quartiles]}
  return rec


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--batches", default="1,2,8")
  p.add_argument("--heads", type=int, default=1, help="1: plain greedy decoding")
  p.add_argument("--options", default="eigen,ynn",
                 help=f"comma-separated, the first the baseline: {', '.join(OPTION_SETS)}")
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--max_new", type=int, default=128)
  p.add_argument("--rounds", type=int, default=12)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  batches = common.positive_ints(p, "--batches", args.batches)
  names = args.options.split(",")
  if any(n not in OPTION_SETS for n in names) or len(set(names)) != len(names) or len(names) < 2:
    p.error(f"--options: two or more distinct of {', '.join(OPTION_SETS)}, got {args.options!r}")
  if args.rounds < 3 or args.max_new < 2 or args.prompt_len < 1:
    p.error("--prompt_len must be >= 1, --rounds >= 3 and --max_new >= 2")
  loaded = common.loaded_workdir(p, args.workdir)
  records = []
  for b in batches:
    rec = bench_batch(loaded, b, args.heads, names, args.prompt_len, args.max_new, args.rounds)
    rec.update(workdir=args.workdir, xla_flags=os.environ.get("XLA_FLAGS", ""))
    records.append(rec)
    print(json.dumps({k: rec[k] for k in ("batch", "heads", "rule", "tokens_equal", "ms_median",
                                          "speed_over_baseline")}), flush=True)
  common.emit(records, args.json)
  return 0 if all(r["tokens_equal"] for r in records) else 1


if __name__ == "__main__":
  sys.exit(main())
