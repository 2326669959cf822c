"""Cold decisions of heads="auto", repeated on one cell: how far what auto predicts and chooses
moves between decisions on one machine, and whether it moves with the machine's pace.

    python experiments/decision_spread.py --workdir runs/proj --batch 1 --prompt_len 64 \\
        --max_new_tokens 128 --decisions 6 --probe_rounds 3,21 \\
        --json experiments/results/decision_spread_projection_bytes_epyc.json

Each decision is a fresh `session.Session` without a disk cache (so it probes and compiles as a
first `generate --k auto` does), on the same held-out prompts (bench_decode.heldout_prompts),
greedy unless --temperature > 0; --probe_rounds alternates the decisions over these values of
`session.PROBE_ROUNDS`. Per decision: what it chose, each candidate's predicted S, and the whole
calls its probe timed: plain decoding's and the probe window's (the chain of all heads). Per
rounds value: each candidate's predicted S (mean, sd), the choices, the correlation of the
probe window's predicted S with plain decoding's call (Pearson, p), and how much of plain's
change in pace the probe window's call follows (the slope of log against log). With two values:
Levene's test of the probe window's S spread between them. --png: that S against plain's call.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import collections
import time

import numpy as np
from scipy import stats

from experiments import common
from experiments.bench_decode import heldout_prompts
from mtp_jax.decoding import session as session_lib


def decide(loaded, prompts, max_new_tokens: int, rounds: int, sample_kw: dict) -> dict:
  """One cold decision with PROBE_ROUNDS = rounds: its choice, table and probe's calls."""
  before, session_lib.PROBE_ROUNDS = session_lib.PROBE_ROUNDS, rounds
  try:
    s = session_lib.Session(loaded.params, loaded.model.args)
    t0 = time.perf_counter()
    k, tree, auto = s.resolve(prompts, max_new_tokens=max_new_tokens, k="auto", tree=None,
                              eos_id=-1, pad_id=loaded.tokenizer.pad_id, **sample_kw)
    seconds = time.perf_counter() - t0
  finally:
    session_lib.PROBE_ROUNDS = before
  p = auto["probe"]
  return {"probe_rounds": rounds, "chose": k, "decision_seconds": seconds,
          "S_predicted": {row["heads"]: row["S_predicted"] for row in auto["table"]
                          if row["S_predicted"] is not None},
          "own_loop": {row["heads"]: bool(row.get("own_loop")) for row in auto["table"]},
          "plain_call_seconds": (p["plain_fixed_seconds"]
                                 + max_new_tokens * p["plain_cycle_seconds"]),
          "probe_call_seconds": p["fixed_seconds"] + (p["cycles"] + 1) * p["cycle_seconds"]}


def summarize(decisions: list[dict], heads: int) -> dict:
  """Per probe_rounds value (module docstring); `heads`: the probe window's (all heads)."""
  out = {}
  for rounds in dict.fromkeys(d["probe_rounds"] for d in decisions):
    ds = [d for d in decisions if d["probe_rounds"] == rounds]
    per = collections.defaultdict(list)
    for d in ds:
      for h, s in d["S_predicted"].items():
        per[h].append(s)
    plain = np.log([d["plain_call_seconds"] for d in ds])
    probe = np.log([d["probe_call_seconds"] for d in ds])
    top = np.log([d["S_predicted"][heads] for d in ds])
    row = {"decisions": len(ds), "chose": dict(collections.Counter(d["chose"] for d in ds)),
           "S_predicted": {h: {"mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1))
                               if len(v) > 1 else None} for h, v in sorted(per.items())},
           "plain_call_seconds": [float(np.exp(plain.min())), float(np.exp(plain.max()))],
           "decision_seconds_mean": float(np.mean([d["decision_seconds"] for d in ds]))}
    if len(ds) > 2 and np.ptp(plain) > 0:
      r = stats.pearsonr(plain, top)
      row.update(r_S_with_plain_call=float(r.statistic), p=float(r.pvalue),
                 probe_call_follows=float(np.polyfit(plain, probe, 1)[0]))
    out[str(rounds)] = row
  groups = [[d["S_predicted"][heads] for d in decisions if d["probe_rounds"] == r]
            for r in dict.fromkeys(d["probe_rounds"] for d in decisions)]
  if len(groups) == 2 and min(map(len, groups)) > 1:
    out["levene_p"] = float(stats.levene(*groups).pvalue)
  return out


def plot(decisions, heads: int, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for rounds in dict.fromkeys(d["probe_rounds"] for d in decisions):
    ds = [d for d in decisions if d["probe_rounds"] == rounds]
    ax.scatter([1e3 * d["plain_call_seconds"] for d in ds], [d["S_predicted"][heads] for d in ds],
               label=f"{rounds} probe rounds", alpha=0.8)
  ax.axhline(1.0, color="grey", ls="--", lw=1)
  ax.set_xlabel("plain decoding's call as the probe timed it (ms)")
  ax.set_ylabel(f"predicted S, heads 1..{heads}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--max_new_tokens", type=int, default=128)
  ap.add_argument("--decisions", type=int, default=6, help="per --probe_rounds value")
  ap.add_argument("--probe_rounds", default=str(session_lib.PROBE_ROUNDS),
                  help="comma-separated PROBE_ROUNDS values, the decisions alternating over them")
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--json", default=None)
  ap.add_argument("--png", default=None)
  args = ap.parse_args(argv)
  rounds = common.positive_ints(ap, "--probe_rounds", args.probe_rounds)
  if args.decisions < 1:
    ap.error(f"--decisions: at least 1, got {args.decisions}")
  loaded = common.loaded_workdir(ap, args.workdir)
  prompts = [list(map(int, p)) for p in heldout_prompts(loaded, args.batch, args.prompt_len)]
  sample_kw = dict(temperature=args.temperature, top_p=0.95) if args.temperature > 0 else {}
  heads = loaded.model.args.n_future
  decisions = []
  for _ in range(args.decisions):
    for r in rounds:
      decisions.append(decide(loaded, prompts, args.max_new_tokens, r, sample_kw))
      d = decisions[-1]
      print(f"decision {len(decisions)}/{args.decisions * len(rounds)} ({r} rounds): heads "
            f"{d['chose']}, S predicted {d['S_predicted'][heads]:.3f} for heads 1..{heads}, "
            f"plain call {1e3 * d['plain_call_seconds']:.1f} ms, {d['decision_seconds']:.1f} s",
            flush=True)
  record = {"workdir": args.workdir, "batch": args.batch, "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "summary": summarize(decisions, heads), "decisions": decisions}
  common.emit(record, args.json)
  if args.png:
    plot(decisions, heads, args.png)
  return record


if __name__ == "__main__":
  main()
