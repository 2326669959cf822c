"""Greedy self-speculative acceptance on held-out prompts: how often each head's draft passes.

    python experiments/decode_acceptance.py --workdir DIR [--n 64 --prompt_len 64 \
        --max_new_tokens 16,128] [--json out.json]

Decodes n windows of validation code (`bench_decode.heldout_prompts`) greedily with all heads
and prints, per generation length, a (tokens per forward) and P(draft j accepted). Short
generations weigh the first cycles after the prompt, where what the drafting heads' caches hold
over the prompt matters most (sequential heads: before the sampling issue, depth 1 read head 1's
guesses over the prompt instead of the prompt). It uses only `decode.decode`, so it runs against
an older checkout of the library too (PYTHONPATH=that checkout) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from experiments import common
from experiments.bench_decode import heldout_prompts
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.workdir import load_workdir


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--n", type=int, default=64)
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--max_new_tokens", default="16,128")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  loaded = load_workdir(args.workdir)
  prompts = [list(map(int, p)) for p in heldout_prompts(loaded, args.n, args.prompt_len)]
  out = {"workdir": args.workdir, "step": loaded.step, "kind": loaded.model.args.head_kind,
         "library": os.path.dirname(os.path.dirname(os.path.abspath(decode_lib.__file__))),
         "n": args.n, "prompt_len": args.prompt_len, "runs": []}
  for max_new in [int(x) for x in args.max_new_tokens.split(",")]:
    r = decode_lib.decode(loaded.params, loaded.model.args, prompts, max_new_tokens=max_new,
                          k=loaded.model.args.n_future, eos_id=-1,
                          pad_id=loaded.tokenizer.pad_id)
    run = {"max_new_tokens": max_new, "a": r.tokens_per_forward,
           "acceptance_by_position": np.round(r.acceptance_by_position(), 4).tolist()}
    out["runs"].append(run)
    print(json.dumps(run), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(common.stamp(out), f, indent=2)


if __name__ == "__main__":
  main()
