"""Where a decoding step's time goes on this machine: the compiled greedy loop (`decode.Decoder`,
the program the CLIs and the benchmarks run) profiled op by op.

    python experiments/profile_decode.py --workdir runs/demo --batches 1,8 [--heads 1] \\
        [--prompt_len 32] [--max_new 128] [--reps 10] [--json out/profile_decode.json]

Per batch: the loop timed untraced (`--reps` calls after a warm-up: seconds per forward), then
one call under `jax.profiler.trace`, whose thunk events are matched to the optimised HLO of the
loop's body (`experiments/hlo_profile.py`): each op of the body gets a class (attention dot,
dot = the weights', reduce, scatter, copy, elementwise; library fusions marked), its shape and its
microseconds per call; the record sums them by class, per cycle. Traced ops run slower than
untraced ones (`traced_over_untraced` says by how much), so read the shares, not the absolute
times, and only where `coverage` (the ops' sum over the traced run's time) is near 1. Random
prompts of --prompt_len tokens; EOS is ignored (fixed work).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import json
import os
import sys
import tempfile

import jax
import numpy as np

from experiments import common, hlo_profile
from mtp_jax.backends.cpu import runtime
from mtp_jax.decoding import decode as decode_lib


def profile_batch(loaded, batch: int, heads: int, prompt_len: int, max_new: int, reps: int,
                  top: int = 25) -> dict:
  dec = decode_lib.Decoder(loaded.params, loaded.model.args, k=heads, batch=batch,
                           prompt_len=prompt_len, max_new_tokens=max_new)
  rng = np.random.default_rng(0)
  vocab = min(loaded.model.args.vocab_size, 256)
  prompts = [rng.integers(3, vocab, size=prompt_len).tolist() for _ in range(batch)]
  call = lambda: dec(prompts, eos_id=-1, pad_id=loaded.tokenizer.pad_id)
  call()
  runs = [call() for _ in range(reps)]
  seconds = float(np.median([r.seconds for r in runs]))
  forwards = runs[0].forwards
  ops = hlo_profile.while_body_ops(dec._compiled.as_text())
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      traced = call()
    total, count = hlo_profile.thunk_times(d)
  prof = hlo_profile.by_class(ops, total, count, top)
  return {
      "batch": batch, "heads": heads, "prompt_len": prompt_len, "max_new_tokens": max_new,
      "reps": reps, "forwards": forwards, "seconds_median": seconds,
      "us_per_forward_untraced": round(seconds / forwards * 1e6, 1),
      "us_per_cycle_traced_ops": prof["us_timed_ops"],
      "traced_over_untraced": round(traced.seconds / seconds, 2),
      # the traced ops' sum over the traced run's time a forward: near 1 when every op's time
      # is its own (no asynchronous dots, no ops side by side; hlo_profile's docstring)
      "coverage": round(prof["us_timed_ops"] * forwards / (traced.seconds * 1e6), 2),
      "ops_in_body": len(ops), "ops_timed": prof["ops_timed"],
      "us_per_cycle_by_class": prof["us_by_class"], "share_by_class": prof["share_by_class"],
      "top_ops": prof["top_ops"], "compile_options": runtime.decode_compiler_options(batch),
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--batches", default="1,8")
  p.add_argument("--heads", type=int, default=1, help="1: plain greedy decoding")
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--max_new", type=int, default=128)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--top", type=int, default=25, help="ops listed per batch")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  batches = common.positive_ints(p, "--batches", args.batches)
  if args.reps < 1 or args.max_new < 2 or args.prompt_len < 1:
    p.error("--reps and --prompt_len must be >= 1 and --max_new >= 2")
  loaded = common.loaded_workdir(p, args.workdir)
  records = []
  for b in batches:
    rec = profile_batch(loaded, b, args.heads, args.prompt_len, args.max_new, args.reps,
                        args.top)
    rec.update(workdir=args.workdir, xla_flags=os.environ.get("XLA_FLAGS", ""))
    records.append(rec)
    print(json.dumps({k: rec[k] for k in ("batch", "us_per_forward_untraced",
                                          "traced_over_untraced", "coverage", "share_by_class")}),
          flush=True)
  common.emit(records, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
