"""One cell's S measured again and again, minutes apart: does it move between measurements more
than each measurement's own interval says, and does auto's probe read it as bench_decode does?

    python experiments/pace_drift.py --workdir runs/proj --batch 1 --prompt_len 64 \\
        --max_new_tokens 128 --k 2 --repeats 12 --reps 15 --gap_seconds 15 \\
        --json experiments/results/pace_drift_projection_bytes_b1p64_epyc.json --png ...

Each repetition compiles plain decoding and the chain of k (or --tree's window, 4,2,1 or
dynamic:N over all heads, as tree=auto probes it) afresh (as each grid and each cold decision
does), then times them two ways on the same held-out prompts (bench_decode's):

- as auto's probe does (`session.PROBE_ROUNDS` rounds, the window first, each window a short run
  then the whole call): S_probe, the ratio of the whole calls' medians, and S_predicted, what
  the cost model makes of those runs (each window's cycle and fixed part by
  `costmodel.cycle_and_fixed`, a by `costmodel.predict_a`, the call's S by `call_speedup`);
- as bench_decode does (`speed.time_modes`, --reps rounds, rotated): S with the 95% bootstrap
  interval of its ratio of medians (`speed.ratio_ci`).

Summary: the spread of log S across repetitions against the spread each interval implies
(Cochran's Q over the repetitions, each weighted by its interval, against chi-square with
repeats - 1 degrees of freedom: a small p says S moves between measurements beyond their
intervals); how many intervals miss the weighted mean; log(S_probe / S) and
log(S_predicted / S) by paired t-tests.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import statistics
import time

import numpy as np
from scipy import stats

from experiments import common
from experiments.bench_decode import heldout_prompts
from mtp_jax.decoding import costmodel, speed
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.decoding import session as session_lib
from mtp_jax.decoding import tree as tree_lib
from mtp_jax.workdir import load_workdir


def measure(loaded, prompts, *, k: int, max_new_tokens: int, reps: int, sample_kw,
            tree=None, rounds: int | None = None) -> dict:
  """One repetition: fresh decoders, the probe's reading, then bench_decode's (module doc).
  tree: a tree window (static or dynamic) over heads 1..k instead of the chain of k. rounds:
  the probe run this many rounds (default PROBE_ROUNDS); beyond PROBE_ROUNDS, S_predicted stays
  the first PROBE_ROUNDS' and S_predicted_all_rounds is all of them."""
  rounds = rounds or session_lib.PROBE_ROUNDS
  shape = dict(batch=len(prompts), prompt_len=max(len(p) for p in prompts),
               max_new_tokens=max_new_tokens, sampling=bool(sample_kw))
  ids = dict(eos_id=-1, pad_id=loaded.tokenizer.pad_id, **(sample_kw or {}))
  decoders = {n: decode_lib.Decoder(loaded.params, loaded.model.args, k=kk, tree=t, **shape)
              for n, kk, t in (("chain", k, tree), ("plain", 1, None))}
  call = lambda n, c=None: decoders[n](prompts, max_cycles=c, **ids)
  for n in decoders:  # a fresh executable's first calls
    call(n)
  runs, last = {n: [] for n in decoders}, {}
  for _ in range(rounds):  # the probe's order: the window, then plain
    for n, kk in (("chain", k), ("plain", 1)):
      short, last[n] = call(n, costmodel.probe_lengths(kk, max_new_tokens)[0]), call(n)
      runs[n].append((short.seconds, short.forwards, last[n].seconds, last[n].forwards))
  window = tree if isinstance(tree, tree_lib.Tree) else costmodel.chain(k)
  a = costmodel.predict_a(last["chain"].rows_hist, window, window, max_new_tokens=max_new_tokens)
  first = session_lib.PROBE_ROUNDS

  def predicted(n_rounds: int) -> float:  # the cost model's S from the probe's first rounds
    (t1, f1), (t, f) = (costmodel.cycle_and_fixed(runs[n][:n_rounds]) for n in ("plain", "chain"))
    return costmodel.call_speedup(a, t1, t, max_new_tokens, f1, f)

  timed = speed.time_modes({n: (lambda n=n: call(n)) for n in ("plain", "chain")}, reps)
  base, other = timed["plain"]["seconds"], timed["chain"]["seconds"]
  whole = {n: [r[2] for r in runs[n][:first]] for n in runs}
  return {"S": statistics.median(base) / statistics.median(other),
          "S_ci": speed.ratio_ci(base, other),
          "S_probe": statistics.median(whole["plain"]) / statistics.median(whole["chain"]),
          "S_predicted": predicted(first),
          **({"S_predicted_all_rounds": predicted(rounds)} if rounds > first else {}),
          "plain_call_seconds": statistics.median(base), "at": time.time()}


def summarize(rows: list[dict]) -> dict:
  """The module docstring's summary over the repetitions."""
  log_s = np.log([r["S"] for r in rows])
  se = np.array([(np.log(r["S_ci"][1]) - np.log(r["S_ci"][0])) / (2 * 1.96) for r in rows])
  se = np.maximum(se, 1e-6)
  w = 1 / se ** 2
  mean = float(np.sum(w * log_s) / np.sum(w))
  q = float(np.sum(w * (log_s - mean) ** 2))
  d = np.log([r["S_probe"] / r["S"] for r in rows])
  m = np.log([r["S_predicted"] / r["S"] for r in rows])
  return {"repeats": len(rows), "S_weighted_mean": float(np.exp(mean)),
          "S_range": [float(np.exp(log_s.min())), float(np.exp(log_s.max()))],
          "sd_log_S_between": float(log_s.std(ddof=1)) if len(rows) > 1 else None,
          "se_log_S_within_mean": float(se.mean()),
          "cochran_q": q, "q_p": float(stats.chi2.sf(q, len(rows) - 1)) if len(rows) > 1 else None,
          "intervals_missing_the_mean": int(sum(not (r["S_ci"][0] <= np.exp(mean) <= r["S_ci"][1])
                                                for r in rows)),
          "log_probe_over_S_mean": float(d.mean()),
          "log_probe_over_S_sd": float(d.std(ddof=1)) if len(rows) > 1 else None,
          "probe_t_p": (float(stats.ttest_1samp(d, 0.0).pvalue)
                        if len(rows) > 2 and np.ptp(d) > 0 else None),
          "log_predicted_over_S_mean": float(m.mean()),
          "log_predicted_over_S_sd": float(m.std(ddof=1)) if len(rows) > 1 else None,
          "predicted_t_p": (float(stats.ttest_1samp(m, 0.0).pvalue)
                            if len(rows) > 2 and np.ptp(m) > 0 else None),
          **(_all_rounds(rows, m) if all("S_predicted_all_rounds" in r for r in rows) else {})}


def _all_rounds(rows: list[dict], m: np.ndarray) -> dict:
  """The longer probe's reading (S_predicted_all_rounds) against S, beside the first
  PROBE_ROUNDS' (m): its mean and sd of log, and the Pitman-Morgan test of the two sds (paired:
  the same repetitions; Pearson's r of their sum and difference, 0 where the sds are equal)."""
  m_all = np.log([r["S_predicted_all_rounds"] / r["S"] for r in rows])
  out = {"log_predicted_all_rounds_over_S_mean": float(m_all.mean()),
         "log_predicted_all_rounds_over_S_sd": float(m_all.std(ddof=1))}
  if len(rows) > 2 and np.ptp(m + m_all) > 0 and np.ptp(m - m_all) > 0:
    out["sd_pitman_morgan_p"] = float(stats.pearsonr(m + m_all, m - m_all).pvalue)
  return out


def plot(rows: list[dict], summary: dict, path: str, title: str) -> None:
  """S per repetition with its 95% interval, the probe's reading beside it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  t0 = rows[0]["at"]
  x = [(r["at"] - t0) / 60 for r in rows]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  lo = [r["S"] - r["S_ci"][0] for r in rows]
  hi = [r["S_ci"][1] - r["S"] for r in rows]
  ax.errorbar(x, [r["S"] for r in rows], yerr=[lo, hi], fmt="o", capsize=3,
              label="S, 95% interval (bench_decode's rounds)")
  ax.scatter(x, [r["S_probe"] for r in rows], marker="x", color="C1",
             label="S as auto's probe reads it (whole calls)")
  ax.scatter(x, [r["S_predicted"] for r in rows], marker="+", color="C2",
             label="S as the cost model reads the probe")
  ax.axhline(summary["S_weighted_mean"], color="grey", ls="--", lw=1)
  ax.set_xlabel("minutes")
  ax.set_ylabel("S of the window over plain decoding")
  ax.set_title(f"{title}: Cochran's Q p = {summary['q_p']:.2g}", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--max_new_tokens", type=int, default=128)
  ap.add_argument("--k", type=int, default=2, help="the chain of heads 1..k against plain")
  ap.add_argument("--tree", default=None,
                  help="a tree instead of the chain (4,2,1 or dynamic:N, over all heads)")
  ap.add_argument("--repeats", type=int, default=12)
  ap.add_argument("--reps", type=int, default=15, help="bench_decode's timed rounds")
  ap.add_argument("--gap_seconds", type=float, default=0.0, help="a pause between repetitions")
  ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled rows (top-p 0.95)")
  ap.add_argument("--probe_rounds", type=int, default=session_lib.PROBE_ROUNDS,
                  help="the probe's rounds; more than PROBE_ROUNDS: also read from all of them")
  ap.add_argument("--json", default=None)
  ap.add_argument("--png", default=None)
  args = ap.parse_args(argv)
  if args.repeats < 2 or args.reps < speed.REPS or args.gap_seconds < 0:
    ap.error(f"--repeats: at least 2, --reps: at least {speed.REPS}, --gap_seconds: >= 0; got "
             f"{args.repeats}, {args.reps}, {args.gap_seconds}")
  if args.probe_rounds < session_lib.PROBE_ROUNDS:
    ap.error(f"--probe_rounds: at least {session_lib.PROBE_ROUNDS}, got {args.probe_rounds}")
  loaded = load_workdir(args.workdir)
  if not 2 <= args.k <= loaded.model.args.n_future:
    ap.error(f"--k: 2 to the model's {loaded.model.args.n_future} heads, got {args.k}")
  tree = None
  if args.tree:
    try:
      tree = tree_lib.parse(args.tree, loaded.model.args.n_future)
    except ValueError as e:
      ap.error(f"--{e}")
    args.k = tree.k
  prompts = heldout_prompts(loaded, args.batch, args.prompt_len)
  sample_kw = (dict(temperature=args.temperature, top_p=0.95, top_k=0, seed=0)
               if args.temperature > 0 else None)
  rows = []
  for i in range(args.repeats):
    if i and args.gap_seconds:
      time.sleep(args.gap_seconds)
    rows.append(measure(loaded, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                        reps=args.reps, sample_kw=sample_kw, tree=tree,
                        rounds=args.probe_rounds))
    r = rows[-1]
    print(f"repetition {i + 1}/{args.repeats}: S {r['S']:.3f} ({r['S_ci'][0]:.3f}-"
          f"{r['S_ci'][1]:.3f}), as the probe reads it {r['S_probe']:.3f} (whole calls), "
          f"{r['S_predicted']:.3f} (the cost model)" + (
              f", {r['S_predicted_all_rounds']:.3f} from all {args.probe_rounds} rounds"
              if "S_predicted_all_rounds" in r else ""), flush=True)
  summary = summarize(rows)
  result = {"workdir": args.workdir, "batch": args.batch, "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens, "k": args.k,
            "tree": tree.name if tree else None, "reps": args.reps,
            "probe_rounds": session_lib.PROBE_ROUNDS, "probe_rounds_all": args.probe_rounds,
            "gap_seconds": args.gap_seconds,
            "sampling": sample_kw, "rows": rows, "summary": summary}
  common.emit(result, args.json)
  if args.png:
    mode = "sampled" if sample_kw else "greedy"
    window = tree.name if tree else f"chain:{args.k}"
    plot(rows, summary, args.png, f"{window}, {mode} b{args.batch} p{args.prompt_len}")
  return result


if __name__ == "__main__":
  main()
