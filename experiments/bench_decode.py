"""Self-speculative decoding against plain decoding on held-out code: a, T1, Tc and S, greedy
and sampled.

    python experiments/bench_decode.py --workdir DIR --json out/bench_decode.json [--png_dir out]

Prompts are windows of real code from the validation split (files the model never trained on).
For every batch size and prompt length, plain decoding (head 1 only) and speculative decoding
(heads 1..k) generate the same number of tokens per row (EOS ignored, so the work is fixed), each
compiled ahead of time (`decode.Decoder`, compile seconds recorded) and timed on a second call;
greedily, and (unless --temperature 0) sampled with --temperature / --top_p / --top_k, where
speculative sampling is distributed as plain sampling but its tokens differ:

  a            mean tokens gained per verification forward, over rows and cycles
  a_batch      plain forwards / speculative forwards: what the slowest row allows the batch
  T1           plain seconds per forward inside the loop (= per token of every row)
  Tc           speculative seconds per cycle inside the loop (one forward over k tokens)
  S_measured   plain wall time / speculative wall time, same tokens
  S_predicted  a_batch * T1_fwd / Tk_fwd (BACKGROUND.md §5): the cost model, from a one-token
               and a k-token cached forward timed on their own, outside any loop (the in-loop
               a * T1 / Tc would equal S_measured by construction)
  off_by       S_predicted / S_measured - 1
  identical    greedy rows: every row's output equals greedy's (sampled rows: null)

Also: acceptance by draft position, the teacher-forced agreement of head k with head 1 on the
same held-out text (what training logs; loops in free generation cannot flatter it), and the rest
of a cycle beyond the k-token forward (acceptance, sampling, cache bookkeeping).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (README, "CPU speed")
  from mtp_jax import runtime
  runtime.apply_cpu_defaults()

import argparse
import json
import os

import jax
import numpy as np

from mtp_jax import decode as decode_lib
from mtp_jax import loss as loss_lib
from mtp_jax.data import builders, pipeline
from mtp_jax.workdir import load_workdir


def heldout_prompts(loaded, n: int, length: int, seed: int = 0) -> list[np.ndarray]:
  """n windows of `length` tokens from validation files long enough to hold them."""
  source = builders.load_source(loaded.config.data, "validation")
  docs = [loaded.tokenizer.encode(builders.record_text(source[i])) for i in range(len(source))]
  docs = [d for d in docs if len(d) >= length + 1]
  if not docs:
    raise ValueError(f"--prompt_lens: no validation file has {length} tokens")
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    d = docs[rng.integers(len(docs))]
    start = rng.integers(0, len(d) - length)
    out.append(d[start:start + length])
  return out


def teacher_forced_agreement(loaded, batches: int = 4) -> list[float]:
  """Head k's argmax against head 1's greedy token at the same target, on validation text."""
  it = pipeline.make_iterator(loaded.config, "validation", repeat=False)
  fn = jax.jit(lambda p, b: loss_lib.model_loss(p, loaded.model, loaded.config, b)[1])
  agree, weight = 0.0, 0.0
  for _, batch in zip(range(batches), it):
    m = jax.device_get(fn(loaded.params, batch))
    agree = agree + np.asarray(m["head_agree"]) * m["head_tokens"]
    weight = weight + np.asarray(m["head_tokens"])
  return (agree / np.maximum(weight, 1)).tolist()


def run_case(loaded, prompts, k, max_new, sample_kw=None):
  """Plain (k = 1) against speculative decoding of the same prompts; sample_kw: sampling
  arguments of `Decoder.__call__` (None: greedy)."""
  shape = dict(batch=len(prompts), prompt_len=max(len(p) for p in prompts),
               max_new_tokens=max_new, sampling=bool(sample_kw))
  plain = decode_lib.Decoder(loaded.params, loaded.model.args, k=1, **shape)
  spec = decode_lib.Decoder(loaded.params, loaded.model.args, k=k, **shape)
  ids = dict(eos_id=-1, pad_id=loaded.tokenizer.pad_id, **(sample_kw or {}))
  for _ in range(2):  # compiled already; the first call warms up, the second is timed
    g, s = plain(prompts, **ids), spec(prompts, **ids)
  T1 = g.seconds / g.forwards
  Tc = s.seconds / s.forwards
  return {
      "mode": "sampled" if sample_kw else "greedy",
      "sampling": sample_kw or None,
      "a": s.tokens_per_forward,
      "a_batch": g.forwards / s.forwards,  # what the slowest row allows the whole batch
      "acceptance_by_position": s.acceptance_by_position().tolist(),
      "T1": T1,
      "Tc": Tc,
      "Tc_over_T1": Tc / T1,
      "S_measured": g.seconds / s.seconds,
      "identical": (bool(np.array_equal(g.tokens, s.tokens)
                         and np.array_equal(g.lengths, s.lengths)) if not sample_kw else None),
      "greedy_seconds": g.seconds,  # plain decoding (k = 1), greedy or sampled
      "speculative_seconds": s.seconds,
      "greedy_forwards": g.forwards,
      "speculative_forwards": s.forwards,
      "tokens_per_row": max_new,
      "greedy_compile_seconds": plain.compile_seconds,
      "speculative_compile_seconds": spec.compile_seconds,
  }


def plots(records, png_dir):
  records = [r for r in records if r.get("mode", "greedy") == "greedy"]
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  os.makedirs(png_dir, exist_ok=True)
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for r in records:
    if r["batch"] == 1:
      pos = np.arange(2, len(r["acceptance_by_position"]) + 2)
      ax.plot(pos, r["acceptance_by_position"], "o-", label=f"prompt {r['prompt_len']}")
      ax.set_xticks(pos)
  ax.set(xlabel="head (draft position)", ylabel="P(draft accepted)", ylim=(0, 1),
         title="Acceptance by head, batch 1")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(png_dir, "decode_acceptance.png"), dpi=120)
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for plen in sorted({r["prompt_len"] for r in records}):
    rs = sorted((r for r in records if r["prompt_len"] == plen), key=lambda r: r["batch"])
    ax.plot([r["batch"] for r in rs], [r["S_measured"] for r in rs], "o-",
            label=f"S measured, prompt {plen}")
    ax.plot([r["batch"] for r in rs], [r["S_predicted"] for r in rs], "x--",
            label=f"a*T1 fwd/Tk fwd, prompt {plen}")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set(xscale="log", xlabel="batch size", ylabel="speed-up over greedy",
         title="Self-speculative speed-up")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(png_dir, "decode_speedup.png"), dpi=120)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--json", default=None)
  ap.add_argument("--png_dir", default=None, help="default: the folder of --json")
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--prompt_lens", default="64,256")
  ap.add_argument("--max_new_tokens", type=int, default=128)
  ap.add_argument("--heads", type=int, default=None, help="k (default: all heads)")
  ap.add_argument("--temperature", type=float, default=0.8, help="sampled rows; 0: greedy only")
  ap.add_argument("--top_p", type=float, default=0.95)
  ap.add_argument("--top_k", type=int, default=0)
  args = ap.parse_args()
  modes = [None]
  if args.temperature > 0:
    modes.append(dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=0))
  loaded = load_workdir(args.workdir)
  k = args.heads or loaded.model.args.n_future
  agree = teacher_forced_agreement(loaded)
  records = []
  print(f"step {loaded.step}, {loaded.model.args.head_kind} heads, k = {k}, "
        f"{args.max_new_tokens} new tokens per row; teacher-forced agreement with head 1 by "
        f"head: {np.round(agree, 3).tolist()}")
  print("| mode | batch | prompt | a | a (batch) | acceptance by head | T1 ms | Tc ms | "
        "T1 fwd ms | Tk fwd ms | S measured | S predicted | off by | identical |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for plen in [int(x) for x in args.prompt_lens.split(",")]:
    for batch in [int(x) for x in args.batches.split(",")]:
      prompts = heldout_prompts(loaded, batch, plen)
      cost = decode_lib.forward_seconds(loaded.params, loaded.model.args, k, batch=batch,
                                         context=plen + args.max_new_tokens // 2)
      for sample_kw in modes:
        r = run_case(loaded, prompts, k, args.max_new_tokens, sample_kw)
        r.update(batch=batch, prompt_len=plen, heads=k, step=loaded.step,
                 teacher_forced_agreement=agree, backend=jax.devices()[0].platform,
                 forward_1_seconds=cost["forward_1"], forward_k_seconds=cost["forward_k"],
                 S_predicted=r["a_batch"] * cost["forward_1"] / cost["forward_k"],
                 cycle_overhead_seconds=r["Tc"] - cost["forward_k"])
        r["off_by"] = r["S_predicted"] / r["S_measured"] - 1
        records.append(r)
        print(f"| {r['mode']} | {batch} | {plen} | {r['a']:.2f} | {r['a_batch']:.2f} | "
              f"{' '.join(f'{x:.2f}' for x in r['acceptance_by_position'])} | "
              f"{1e3 * r['T1']:.1f} | {1e3 * r['Tc']:.1f} | {1e3 * cost['forward_1']:.1f} | "
              f"{1e3 * cost['forward_k']:.1f} | {r['S_measured']:.2f} | {r['S_predicted']:.2f} | "
              f"{100 * r['off_by']:+.0f}% | {r['identical']} |", flush=True)
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(records, f, indent=2)
  png_dir = args.png_dir or (os.path.dirname(os.path.abspath(args.json)) if args.json else None)
  if png_dir:
    plots(records, png_dir)


if __name__ == "__main__":
  main()
