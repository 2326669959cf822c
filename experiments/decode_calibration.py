"""bench_decode's calibration (`<json>_calibration.json`): the cost model against the clock over
a grid of decoding records, and auto judged against the best variant of each cell."""

from __future__ import annotations

import numpy as np

from mtp_jax.decoding import costmodel


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
  chose is within 15% of the clock (`cost_model_within_15pct`)."""
  out = {}
  for mode in dict.fromkeys(r["mode"] for r in records):
    rs = [r for r in records if r["mode"] == mode]
    off = np.abs([r["off_by"] for r in rs])
    autos = []
    for r in (r for r in rs if r.get("auto")):
      cell = [x for x in rs if (x["batch"], x["prompt_len"]) == (r["batch"], r["prompt_len"])
              and not x.get("auto")]
      best = max(cell, key=lambda x: x["S_measured"], default=None)
      best_name, best_S = (("plain", 1.0) if best is None or best["S_measured"] < 1.0 else
                           (best["variant"], best["S_measured"]))
      bet = r["heads"] > 1 or r["tree"] is not None
      weighed, bounded = candidate_off_by(r, cell)
      autos.append({
          "batch": r["batch"], "prompt_len": r["prompt_len"], "variant": r["variant"],
          "chose": f"k={r['heads']}" + (f" tree {r['tree']}" if r["tree"] else ""),
          "S_measured": r["S_measured"], "S_band": r["S_band"], "S_ci": r.get("S_ci"),
          "S_ci_within_10pct": r.get("S_ci_within_10pct"),
          "best_variant": best_name, "S_best": best_S,
          "auto_over_best": r["S_measured"] / best_S,
          "holds": bool(r["S_measured"] >= 0.95 * best_S),
          "S_predicted_auto": r["S_predicted_auto"], "off_by_auto": r["off_by_auto"],
          "cost_model_within_15pct": bool(abs(r["off_by_auto"]) <= 0.15) if bet else None,
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
  return out
