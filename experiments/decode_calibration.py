"""bench_decode's calibration (`<json>_calibration.json`): the cost model against the clock over
a grid of decoding records, and auto judged against the best variant of each cell."""

from __future__ import annotations

import numpy as np

from mtp_jax.decoding import costmodel, speed

HOLD = 0.95  # auto holds at this fraction of the best variant's S
WITHIN = 0.15  # the cost model's allowance where it bets


def judged(value: float, ci, lo: float, hi: float = float("inf")) -> str:
  """'holds' where `value` lies in [lo, hi]; 'within the noise' where it does not but its 95%
  interval `ci` meets [lo, hi] (the clock cannot tell); 'misses' where the interval is out."""
  if lo <= value <= hi:
    return "holds"
  if ci is not None and ci[0] <= hi and ci[1] >= lo:
    return "within the noise"
  return "misses"


def over_best_ci(r, best):
  """The 95% interval of auto's S over the best variant's: median(best) / median(auto) over
  resampled rounds (both timed in each round, so a change of load hits them alike); against
  plain decoding (`best` None) auto's S. Records without their calls' seconds: auto's S_ci."""
  if "speculative_seconds_all" not in r:
    return r.get("S_ci") if best is None else None
  base = r["greedy_seconds_all"] if best is None else best.get("speculative_seconds_all")
  return None if base is None else speed.ratio_ci(base, r["speculative_seconds_all"])


def crossfit_over_best(plain, fixed: dict, other) -> dict | None:
  """`other`'s calls (auto's) against the best variant of the cell, chosen without the round
  it is measured on: for each timed round i, the best of plain decoding and the `fixed`
  variants ({name: seconds of its calls}) by their S over every round but i, and that
  variant's call of round i over `other`'s. Returns the median of those per-round ratios
  ("value"), its 95% interval (`speed.paired_ci`) and how many rounds chose each variant
  ("best"); None without every call's seconds.

  The best of several S measured in the same rounds is the largest of noisy draws, so judged
  against it a decider that picks the truly best variant still falls short by the draws'
  spread (docs/decoding.md, "The best variant, chosen on other rounds"); a variant chosen on
  other rounds is measured on an independent draw."""
  if plain is None or other is None or any(v is None for v in fixed.values()):
    return None
  secs = {"plain": np.asarray(plain, float), **{k: np.asarray(v, float)
                                                 for k, v in fixed.items()}}
  n = min(len(other), *(len(v) for v in secs.values()))
  if n < 2:
    return None
  secs = {k: v[:n] for k, v in secs.items()}
  best, picks = [], {}
  for i in range(n):
    keep = np.arange(n) != i
    S = {k: np.median(secs["plain"][keep]) / np.median(v[keep]) for k, v in secs.items()}
    name = max(S, key=S.get)  # a tie keeps plain decoding (first)
    picks[name] = picks.get(name, 0) + 1
    best.append(float(secs[name][i]))
  other = np.asarray(other, float)[:n]
  return {"value": float(np.median(np.asarray(best) / np.maximum(other, 1e-12))),
          "ci": speed.paired_ci(best, list(other)), "best": picks}


def candidate_off_by(auto_rec, cell) -> list[dict]:
  """auto's own prediction for each candidate it weighed (its table: the pessimistic a, the
  timed forwards, the probes' loop factors; `own_loop`: its T measured on its own decoding loop,
  as auto does for its picks) against the S that candidate measured in the same
  cell when it ran as a fixed variant: the cost model as auto uses it, judged on every
  candidate, not only on the one it picked. Candidates auto did not time (`costmodel.bounds`):
  their bound against the S they measured, in the second list."""
  out, bounds = [], []
  for row in auto_rec["auto"].get("table", []):
    chain = set(str(row["tree"]).split(",")) <= {"", "1"}  # a chain of k: k - 1 ones
    same = [x for x in cell if row["heads"] > 1 and (
        (x["tree"] is None and x["heads"] == row["heads"]) if chain else x["tree"] == row["tree"])]
    for x in same[:1]:
      if row["S_predicted"] is None:  # not timed: its bound, which the clock must not beat
        bounds.append({"variant": x["variant"], "S_bound": row["S_bound"],
                       "S_measured": x["S_measured"], "held": x["S_measured"] <= row["S_bound"]})
        continue
      out.append({"variant": x["variant"], "S_predicted": row["S_predicted"],
                  "a_predicted": row["a_predicted"], "S_measured": x["S_measured"],
                  "a_batch": x.get("a_batch"), "off_by": row["S_predicted"] / x["S_measured"] - 1,
                  "predicts_speculation": bool(row["S_predicted"] >= costmodel.MIN_GAIN),
                  "own_loop": bool(row.get("own_loop"))})  # its T its own loop's, measured
  return out, bounds


def calibration(records) -> dict:
  """The cost model against the clock over the grid, per mode: off_by (S predicted from the
  measured a over S measured, - 1) as median and largest |off_by|; and auto judged against the
  best variant of its cell, measured in the same run (plain decoding, S = 1, included): its S
  over the best one's, holding at >= 0.95 (never by definition: a cell where auto chose plain
  decoding is judged like any other, against a variant that beat plain decoding there). Each
  auto cell also says whether its S is known within +-10% (`S_ci`, the 95% interval of the
  median paired ratio), and, where auto bet on speculation, whether what it predicted when it
  chose is within 15% of the clock (`cost_model_within_15pct`). Both verdicts also come with
  their noise (`judged`, `cost_model_judged`: holds, within the noise, misses): auto over the
  best variant with the 95% interval of their paired rounds (`auto_over_best_ci`), and the
  prediction against the ends of auto's S interval (`off_by_auto_ci`), both intervals of ratios
  of medians over resampled rounds (`speed.ratio_ci`); each mode counts them. The best of the
  cell's S is the largest of noisy draws, so `judged_crossfit` judges auto again against the
  best variant chosen on the other rounds (`crossfit_over_best`), the unbiased reading."""
  out = {}
  for mode in dict.fromkeys(r["mode"] for r in records):
    rs = [r for r in records if r["mode"] == mode]
    off = np.abs([r["off_by"] for r in rs])
    autos = []
    for r in (r for r in rs if r.get("auto")):
      cell = [x for x in rs if (x["batch"], x["prompt_len"]) == (r["batch"], r["prompt_len"])
              and not x.get("auto")]
      best = max(cell, key=lambda x: x["S_measured"], default=None)
      if best is not None and best["S_measured"] < 1.0:
        best = None  # plain decoding, S = 1
      best_name, best_S = ("plain", 1.0) if best is None else (best["variant"], best["S_measured"])
      bet = r["heads"] > 1 or r["tree"] is not None
      weighed, bounded = candidate_off_by(r, cell)
      over_ci = over_best_ci(r, best)
      cf = crossfit_over_best(r.get("greedy_seconds_all"),
                              {x["variant"]: x.get("speculative_seconds_all") for x in cell},
                              r.get("speculative_seconds_all"))
      pred, S_ci = r["S_predicted_auto"], over_best_ci(r, None)
      off_ci = None if S_ci is None else [pred / S_ci[1] - 1, pred / S_ci[0] - 1]
      autos.append({
          "batch": r["batch"], "prompt_len": r["prompt_len"], "variant": r["variant"],
          "chose": f"k={r['heads']}" + (f" tree {r['tree']}" if r["tree"] else ""),
          "S_measured": r["S_measured"], "S_band": r["S_band"], "S_ci": r.get("S_ci"),
          "S_ci_within_10pct": r.get("S_ci_within_10pct"),
          "best_variant": best_name, "S_best": best_S,
          "auto_over_best": r["S_measured"] / best_S,
          "auto_over_best_ci": over_ci,
          "holds": bool(r["S_measured"] >= HOLD * best_S),
          "judged": judged(r["S_measured"] / best_S, over_ci, HOLD),
          # the same with the best chosen on the other rounds (None without the calls' seconds)
          "auto_over_best_crossfit": cf and cf["value"],
          "auto_over_best_crossfit_ci": cf and cf["ci"],
          "best_crossfit": cf and cf["best"],
          "judged_crossfit": cf and judged(cf["value"], cf["ci"], HOLD),
          "S_predicted_auto": pred, "off_by_auto": r["off_by_auto"], "off_by_auto_ci": off_ci,
          "cost_model_within_15pct": bool(abs(r["off_by_auto"]) <= WITHIN) if bet else None,
          "cost_model_judged": (judged(r["off_by_auto"], off_ci, -WITHIN, WITHIN)
                                if bet else None),
          "candidates": weighed, "bounds": bounded,
          **{f: r.get(f) for f in ("S_with_decision", "S_with_decision_cached",
                                   "auto_decision_seconds", "auto_decision_seconds_cached")},
          "plain": not bet})
    cands = [c for a in autos for c in a["candidates"]]
    bets = [c for c in cands if c["predicts_speculation"]]
    bounds = [c for a in autos for c in a["bounds"]]
    out[mode] = {"cells": len(rs), "off_by_median_abs": float(np.median(off)),
                 "off_by_max_abs": float(off.max()), "auto": autos,
                 "candidates_off_by_median_abs": (float(np.median([abs(c["off_by"])
                                                                  for c in cands]))
                                                  if cands else None),
                 "candidates_within_15pct": sum(abs(c["off_by"]) <= 0.15 for c in cands),
                 "candidates_compared": len(cands),
                 "predicted_speculation_within_15pct": sum(abs(c["off_by"]) <= 0.15
                                                           for c in bets),
                 "predicted_speculation": len(bets),
                 "bounds_held": sum(c["held"] for c in bounds), "bounds_compared": len(bounds)}
    if autos:
      out[mode]["auto_holds"] = all(a["holds"] for a in autos)
      for what in ("judged", "judged_crossfit", "cost_model_judged"):
        verdicts = [a[what] for a in autos if a[what]]
        out[mode][what] = {v: verdicts.count(v) for v in ("holds", "within the noise", "misses")}
  return out
