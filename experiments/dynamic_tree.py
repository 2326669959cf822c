"""Dynamic draft trees against static ones of the same node count: tokens per cycle a.

    python experiments/dynamic_tree.py --workdir DIR --json experiments/results/dynamic_tree.json \\
        [--nodes 9,13,21] [--prompts 16] [--prompt_len 64] [--max_new_tokens 128]

For each node count N: `dynamic:N` (the root and the N - 1 most likely paths of the drafting heads,
chosen per cycle) and every static spec of N nodes over at most n_future - 1 depths (a tree: some
depth wider than one), greedy and (unless --temperature 0) sampled, on --prompts held-out
windows of --prompt_len tokens (bench_decode.heldout_prompts), EOS ignored. a is tokens gained
per verification forward, each row's cycles counted while it runs (as at batch 1: the rows of
one call do not share cycles). Greedy rows are also checked against plain greedy decoding. Each
record: mode, nodes, tree, a, the static spec of highest a for that N and mode, and
dynamic_minus_best_static.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import itertools
import json
import os

import numpy as np

from experiments import common
from experiments.bench_decode import heldout_prompts
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.decoding import tree as tree_lib
from mtp_jax.workdir import load_workdir


def static_specs(nodes: int, levels: int) -> list[str]:
  """Every spec of `nodes` nodes over 1..levels depths with some depth wider than one."""
  out = []
  for depth in range(1, levels + 1):
    for spec in itertools.product(range(1, nodes), repeat=depth):
      t = tree_lib.Tree(spec)
      if max(spec) > 1 and t.n_nodes == nodes:
        out.append(t.name)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--json", default=None)
  ap.add_argument("--nodes", default="9,13,21")
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--max_new_tokens", type=int, default=128)
  ap.add_argument("--temperature", type=float, default=0.8, help="sampled rows; 0: greedy only")
  ap.add_argument("--top_p", type=float, default=0.95)
  args = ap.parse_args(argv)
  loaded = load_workdir(args.workdir)
  margs = loaded.model.args
  prompts = [list(map(int, p)) for p in heldout_prompts(loaded, args.prompts, args.prompt_len)]
  modes = [dict(temperature=0.0)]
  if args.temperature > 0:
    modes.append(dict(temperature=args.temperature, top_p=args.top_p, seed=0))
  kw = dict(max_new_tokens=args.max_new_tokens, eos_id=-1, pad_id=loaded.tokenizer.pad_id)
  plain = decode_lib.plain(loaded.params, margs, prompts, **kw)
  records = []
  print(f"step {loaded.step}, {margs.head_kind} heads, n_future {margs.n_future}, "
        f"{len(prompts)} prompts of {args.prompt_len} tokens, {args.max_new_tokens} new tokens")
  print("| mode | nodes | dynamic a | best static (a) | dynamic - best static | statics tried |")
  print("|---|---|---|---|---|---|")
  for n in [int(x) for x in args.nodes.split(",")]:
    specs = [f"dynamic:{n}"] + static_specs(n, margs.n_future - 1)
    for mode in modes:
      rows = []
      for spec in specs:
        r = decode_lib.decode(loaded.params, margs, prompts, tree=spec, **kw, **mode)
        same = (bool(np.array_equal(r.tokens, plain.tokens)) if mode["temperature"] == 0
                else None)
        rows.append({"mode": "greedy" if mode["temperature"] == 0 else "sampled",
                     "sampling": mode, "nodes": n, "tree": r.tree, "heads": r.heads,
                     "a": r.tokens_per_forward, "forwards": r.forwards,
                     "accepted_hist": r.accepted_hist.tolist(), "identical": same})
        assert same is not False, (spec, "differs from plain greedy")
      dyn, static = rows[0], rows[1:]
      best = max(static, key=lambda x: x["a"])
      for x in rows:
        x.update(best_static=best["tree"], best_static_a=best["a"],
                 dynamic_minus_best_static=dyn["a"] - best["a"],
                 prompts=len(prompts), prompt_len=args.prompt_len,
                 max_new_tokens=args.max_new_tokens, step=loaded.step)
      records += rows
      print(f"| {dyn['mode']} | {n} | {dyn['a']:.2f} | {best['tree']} ({best['a']:.2f}) | "
            f"{dyn['a'] - best['a']:+.2f} | {len(static)} |", flush=True)
      if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
          json.dump(common.stamp(records), f, indent=2)


if __name__ == "__main__":
  main()
