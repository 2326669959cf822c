"""Tokens decoded per HumanEval problem with the stop sequences checked inside the decode loop
against decoding max_new_tokens and cutting afterwards (the same completions, checked here).

    python experiments/bench_stops.py --workdir DIR --limit 20 --max_new_tokens 256 \\
        [--mode speculative] [--temperature 0.8 --top_p 0.95] [--out FILE.json]

Prints JSON: per problem the tokens decoded both ways, their means, the decode seconds of each
(compilation excluded; both runs compile once each), whether every completion after the cut is
identical (sampled rows too: each row's stream is keyed by its position), and the machine.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import os

from experiments import common
from mtp_jax.backends.cpu import runtime
from mtp_jax.evaluation import code_tasks, passk
from mtp_jax.generate import load_workdir


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--limit", type=int, default=20)
  ap.add_argument("--max_new_tokens", type=int, default=256)
  ap.add_argument("--mode", default="speculative", choices=("speculative", "greedy"))
  ap.add_argument("--batch_size", type=int, default=4)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--top_p", type=float, default=1.0)
  ap.add_argument("--out", default="")
  a = ap.parse_args(argv)
  loaded = load_workdir(a.workdir)
  tok = loaded.tokenizer
  max_len = loaded.model.args.max_len
  problems = [p for p in code_tasks.humaneval_problems()
              if len(tok.encode(p.prompt)) + a.max_new_tokens <= max_len][:a.limit]
  prompts = [tok.encode(p.prompt) for p in problems]
  runs = {}
  for name, stops in (("post_hoc", ()), ("in_loop", code_tasks.HUMANEVAL_STOPS)):
    gen = passk.generate_completions(
        loaded, prompts, num_samples=1, temperature=a.temperature, top_p=a.top_p, top_k=0, seed=0,
        mode=a.mode, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, stops=stops)
    runs[name] = {"tokens": [len(t) for t in gen.tokens], "seconds": gen.seconds,
                  "completions": [code_tasks.truncate(tok.decode(t), p.stops)
                                  for t, p in zip(gen.tokens, problems)]}
  before, after = runs["post_hoc"]["tokens"], runs["in_loop"]["tokens"]
  result = {
      "workdir": os.path.abspath(a.workdir), "step": getattr(loaded, "step", None),
      "mode": a.mode, "max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size,
      "temperature": a.temperature, "top_p": a.top_p,
      "problems": [p.task_id for p in problems],
      "tokens_post_hoc": before, "tokens_in_loop": after,
      "mean_tokens_post_hoc": sum(before) / len(before),
      "mean_tokens_in_loop": sum(after) / len(after),
      "seconds_post_hoc": round(runs["post_hoc"]["seconds"], 3),
      "seconds_in_loop": round(runs["in_loop"]["seconds"], 3),
      "identical_completions": runs["post_hoc"]["completions"] == runs["in_loop"]["completions"],
      "machine": common.machine_info()}
  common.emit(result, a.out, indent=1)


if __name__ == "__main__":
  main()
