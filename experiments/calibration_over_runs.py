"""Several bench_decode grids of one model on one machine, read together (no decoding): what one
grid cannot tell apart from its noise.

- The cost model's bias by where a candidate's T came from: its own decoding loop (`own_loop`)
  or the forward ratios scaled by the probe's loop factor; per auto variant and batch, the mean
  of log(S predicted / S measured) over every candidate auto weighed that also ran as a fixed
  variant, its standard error and a one-sample t-test's p against no bias.
- The same by mode, batch and the candidate's drafts (a chain's or a tree's), with the share of
  its a: log(a predicted / a measured).
- auto against the best variant of its cell (S at least HOLD of it: docs/decoding.md), beside
  what the noise allows: the leave-one-run-out pick, in each run and cell the variant (plain
  decoding, S 1, included) of highest mean S over the other runs. It knows each variant's mean
  but not this run's draw, so the cells where it misses HOLD are the noise's (the best of six
  noisy S is the largest draw). auto and that pick are compared cell by cell (exact McNemar).
- The same judgement with the best chosen on the other rounds of the cell (`crossfit`, from the
  calls' seconds: the largest of noisy S overstates the best, and the pick's S is one of those
  draws while auto's is another): auto's own calls, its decision's (its choice's calls as a
  fixed variant) and the pick's; the decision against the pick by exact McNemar.
- Plain decoding against itself: auto's S where it chose plain decoding, the spread of one S.
- The cost model where auto bet (`bets`): its pick's log(S predicted / S measured), with a t-test;
  the same of the S its choice read, paired with the held-out probe's where it has one.
- --before: older grids (say, before a change to auto) compared with these: auto's log(S over
  the best) and the bets' log(S predicted / S measured) by Welch's t-test, and the cells holding
  HOLD by Fisher's exact test.

  python experiments/calibration_over_runs.py A.json B.json ... [--before X.json ...]
      [--modes greedy,sampled] [--autos auto,auto_tree] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import numpy as np
from scipy import stats

from experiments import common
from experiments.decode_calibration import (HOLD, calibration, candidate_off_by,
                                            crossfit_over_best)

AUTO = ("auto", "auto_tree")


def load(path: str) -> dict:
  """{(mode, batch, prompt_len): {variant: record}} of a bench_decode JSON."""
  with open(path) as f:
    records = json.load(f)
  cells = collections.defaultdict(dict)
  for r in records:
    cells[(r["mode"], r["batch"], r["prompt_len"])][r["variant"]] = r
  return dict(cells)


def _fixed(cell: dict) -> dict:
  """{variant: S} of a cell's fixed variants, plain decoding (S 1) included."""
  return {"plain": 1.0, **{v: r["S_measured"] for v, r in cell.items() if v not in AUTO}}


def _mean_test(xs) -> dict:
  xs = np.asarray(xs, np.float64)
  out = {"n": len(xs), "mean_log": float(xs.mean()) if len(xs) else None}
  if len(xs) > 1:
    out.update(se=float(xs.std(ddof=1) / np.sqrt(len(xs))),
               p=float(stats.ttest_1samp(xs, 0.0).pvalue))
  return out


def _weighed(runs: list[dict]):
  """(auto variant, its record, a candidate it weighed and timed, as `candidate_off_by` reads
  it against the same cell's fixed variant) over every run and cell."""
  for cells in runs:
    for cell in cells.values():
      fixed = [r for v, r in cell.items() if v not in AUTO]
      for v in AUTO:
        if v in cell and cell[v].get("auto"):
          for c in candidate_off_by(cell[v], fixed)[0]:
            yield v, cell[v], c


def bias(runs: list[dict]) -> list[dict]:
  """The cost model's bias per auto variant, source of T and batch (module docstring)."""
  groups = collections.defaultdict(list)
  for v, r, c in _weighed(runs):
    src = "own loop" if c["own_loop"] else "forward ratios"
    groups[(v, src, r["batch"])].append(np.log1p(c["off_by"]))
  return [{"auto": v, "T_from": src, "batch": b, **_mean_test(xs)}
          for (v, src, b), xs in sorted(groups.items(), key=str)]


def bias_by_drafts(runs: list[dict]) -> list[dict]:
  """The cost model's bias per auto variant, mode, batch and the candidate's drafts (a chain's or
  a tree's), with its a's share: the mean of log(a predicted / a measured) beside the S's. A
  sampled chain draws its drafts and a tree takes the heads' top ranks, so a tree's walk does not
  give a sampled chain's a (docs/decoding.md, "Sampled chains beside trees")."""
  groups = collections.defaultdict(list)
  for v, r, c in _weighed(runs):
    drafts = "chain" if c["variant"].startswith("chain") else "tree"
    a = np.log(c["a_predicted"] / c["a_batch"]) if c.get("a_batch") else None
    groups[(v, r["mode"], r["batch"], drafts)].append((np.log1p(c["off_by"]), a))
  return [{"auto": v, "mode": m, "batch": b, "drafts": d, **_mean_test([x for x, _ in xs]),
           "a": _mean_test([a for _, a in xs if a is not None])}
          for (v, m, b, d), xs in sorted(groups.items(), key=str)]


def _bet_records(runs: list[dict]) -> list[dict]:
  """auto's records where it bet (its pick not plain decoding)."""
  return [r for cells in runs for cell in cells.values() for v, r in cell.items()
          if v in AUTO and r.get("S_predicted_auto") and _choice(r) != "plain"]


def _bet_log(r: dict, field: str = "S_predicted_auto") -> float:
  """log(S predicted / S measured) of auto's pick in a record where it bet; field
  "S_chosen_auto": the S its choice read (before a held-out probe: the one predicted)."""
  return float(np.log(r.get(field, r["S_predicted_auto"]) / r["S_measured"]))


def _bet_logs(runs: list[dict]) -> list[float]:
  return [_bet_log(r) for r in _bet_records(runs)]


def bets(runs: list[dict]) -> dict:
  """The cost model where auto bet: the mean of log(S predicted / S measured) of its pick (t-test
  against no bias), and how many were within 15%. A choice selects the probes that drew high,
  so a bias shows here that the candidates' (`bias`) does not (docs/decoding.md, "Bets probed
  twice"). "chosen": the same of the S the choice read, and where a held-out probe predicted
  (S_chosen_auto), the paired t-test of the two ("A reading the choice did not use")."""
  recs = _bet_records(runs)
  xs, chosen = [_bet_log(r) for r in recs], [_bet_log(r, "S_chosen_auto") for r in recs]
  within = lambda v: int(sum(abs(np.expm1(x)) <= 0.15 for x in v))
  sd = lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else None
  held = [(x, c) for x, c, r in zip(xs, chosen, recs) if "S_chosen_auto" in r]
  out = {**_mean_test(xs), "sd": sd(xs), "within_15pct": within(xs),
         "chosen": {**_mean_test(chosen), "sd": sd(chosen), "within_15pct": within(chosen)},
         "held_out": len(held)}
  if len(held) > 1:
    out["held_out_paired_p"] = float(stats.ttest_rel(*zip(*held)).pvalue)
  return out


def _choice(rec: dict) -> str:
  """The fixed variant's name of what auto chose: plain, chain:k or tree:SPEC."""
  if rec["heads"] == 1 and not rec["tree"]:
    return "plain"
  return f"chain:{rec['heads']}" if rec["tree"] is None else f"tree:{rec['tree']}"


def _crossfit(cell: dict, name: str | None, auto_rec: dict | None = None) -> float | None:
  """`crossfit_over_best`'s value for auto's own calls (`auto_rec`) or a fixed variant's
  (`name`, plain included) against the cell's best chosen on the other rounds."""
  fixed = {v: r for v, r in cell.items() if v not in AUTO}
  plain = next((r.get("greedy_seconds_all") for r in cell.values()), None)
  secs = {v: r.get("speculative_seconds_all") for v, r in fixed.items()}
  calls = (auto_rec.get("speculative_seconds_all") if auto_rec is not None
           else plain if name == "plain" else secs.get(name))
  cf = crossfit_over_best(plain, secs, calls) if name is not None or auto_rec else None
  return cf and cf["value"]


def against_best(runs: list[dict]) -> list[dict]:
  """Per run, cell and auto variant: auto's S over the cell's best S, and the leave-one-run-out
  pick's (None with one run); and with the best chosen on the other rounds of the cell
  (`decode_calibration.crossfit_over_best`): auto's own calls, its choice's calls as a fixed
  variant (`decision_*`: None where it chose none of them), the pick's."""
  out = []
  for i, cells in enumerate(runs):
    for key, cell in cells.items():
      fixed = _fixed(cell)
      best = max(fixed.values())
      others = [_fixed(c[key]) for j, c in enumerate(runs) if j != i and key in c]
      pick = None
      if others:
        means = {v: np.mean([o[v] for o in others if v in o]) for v in fixed
                 if any(v in o for o in others)}
        pick = max(means, key=means.get)
      for v in AUTO:
        if v in cell and cell[v].get("auto"):
          chose = _choice(cell[v])
          out.append({"run": i, "mode": key[0], "batch": key[1], "prompt_len": key[2],
                      "auto": v, "chose": cell[v]["heads"], "S": cell[v]["S_measured"],
                      "auto_over_best": cell[v]["S_measured"] / best, "pick": pick,
                      "pick_over_best": None if pick is None else fixed[pick] / best,
                      "choice": chose, "auto_over_best_crossfit": _crossfit(cell, None, cell[v]),
                      "decision_over_best_crossfit": (_crossfit(cell, chose) if chose in fixed
                                                      else None),
                      "pick_over_best_crossfit": _crossfit(cell, pick)})
  return out


def _holds(rows, what) -> int:
  return sum(r[what] >= HOLD for r in rows if r[what] is not None)


def summary(runs: list[dict], before: list[dict] | None = None) -> dict:
  rows = against_best(runs)
  paired = [r for r in rows if r["pick_over_best"] is not None]
  only_auto = sum(r["auto_over_best"] >= HOLD > r["pick_over_best"] for r in paired)
  only_pick = sum(r["pick_over_best"] >= HOLD > r["auto_over_best"] for r in paired)
  plain = [r["S"] for r in rows if r["chose"] == 1]
  out = {"runs": len(runs), "hold": HOLD, "bias": bias(runs),
         "bias_by_drafts": bias_by_drafts(runs),
         "auto_holds": _holds(rows, "auto_over_best"), "auto_cells": len(rows),
         "auto_over_best_mean": float(np.mean([r["auto_over_best"] for r in rows])),
         "pick_holds": _holds(paired, "pick_over_best"), "pick_cells": len(paired),
         "pick_over_best_mean": (float(np.mean([r["pick_over_best"] for r in paired]))
                                 if paired else None),
         "mcnemar_p": (float(stats.binomtest(only_auto, only_auto + only_pick).pvalue)
                       if only_auto + only_pick else None),
         "plain_against_plain": {"n": len(plain), "mean": float(np.mean(plain)) if plain else None,
                                 "sd": float(np.std(plain, ddof=1)) if len(plain) > 1 else None},
         "cells": rows}
  out["crossfit"] = _crossfit_summary(rows)
  out["verdicts"] = verdicts(runs)
  out["bets"] = bets(runs)
  if before:
    old = against_best(before)
    log = lambda rs: [np.log(r["auto_over_best"]) for r in rs]
    held = _holds(old, "auto_over_best")
    table = [[out["auto_holds"], len(rows) - out["auto_holds"]], [held, len(old) - held]]
    out["before"] = {"runs": len(before), "auto_holds": held, "auto_cells": len(old),
                     "auto_over_best_mean": float(np.mean([r["auto_over_best"] for r in old])),
                     "welch_p": float(stats.ttest_ind(log(rows), log(old), equal_var=False).pvalue),
                     "fisher_p": float(stats.fisher_exact(table).pvalue),
                     "bets": bets(before)}
    now_b, old_b = _bet_logs(runs), _bet_logs(before)
    if len(now_b) > 1 and len(old_b) > 1:
      out["before"]["bets_welch_p"] = float(stats.ttest_ind(now_b, old_b, equal_var=False).pvalue)
  return out


def verdicts(runs: list[dict]) -> dict:
  """Each grid's own verdicts with their noise (bench_decode's calibration: holds, within the
  noise, misses), summed over the runs: auto against the best variant (`judged`, and
  `judged_crossfit` with the best chosen on the other rounds) and the cost model where auto bet
  (`cost_model_judged`, within 15% of the clock)."""
  out = {w: collections.Counter() for w in ("judged", "judged_crossfit", "cost_model_judged")}
  for cells in runs:
    records = [r for cell in cells.values() for r in cell.values()]
    if not all("off_by" in r and (not r.get("auto") or "off_by_auto" in r) for r in records):
      continue  # not a grid bench_decode wrote (no cost model beside it)
    cal = calibration(records)
    for c in cal.values():
      for w in out:
        out[w].update(c.get(w) or {})
  return {w: dict(c) for w, c in out.items()}


def _crossfit_summary(rows: list[dict]) -> dict:
  """The judgement with the best chosen on the other rounds: cells holding HOLD for auto's own
  calls, its decision's and the pick's, and the decision against the pick (exact McNemar over the
  cells where both were timed as fixed variants and one holds)."""
  keys = ("auto", "decision", "pick")
  have = {k: [r for r in rows if r[f"{k}_over_best_crossfit"] is not None] for k in keys}
  out = {f"{k}_holds": _holds(have[k], f"{k}_over_best_crossfit") for k in keys}
  out.update({f"{k}_cells": len(have[k]) for k in keys})
  out["auto_over_best_mean_log"] = (float(np.mean([np.log(r["auto_over_best_crossfit"])
                                                   for r in have["auto"]]))
                                    if have["auto"] else None)
  both = [r for r in have["decision"] if r["pick_over_best_crossfit"] is not None]
  d = sum(r["decision_over_best_crossfit"] >= HOLD > r["pick_over_best_crossfit"] for r in both)
  p = sum(r["pick_over_best_crossfit"] >= HOLD > r["decision_over_best_crossfit"] for r in both)
  out.update(decision_and_pick_cells=len(both), only_decision_holds=d, only_pick_holds=p,
             mcnemar_p=float(stats.binomtest(d, d + p).pvalue) if d + p else None)
  return out


def plot(result: dict, path: str) -> None:
  """auto's S over the best (and the leave-one-run-out pick's) per cell, one point a run."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = result["cells"]
  names = list(dict.fromkeys(f"{r['mode'][0]} b{r['batch']} p{r['prompt_len']}" for r in rows))
  fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names)), 3.5))
  cf = result["crossfit"]["auto_cells"] == len(rows)  # every cell with its calls' seconds
  tail = "_crossfit" if cf else ""
  for what, marker, dx in (("auto", "o", -0.15), ("auto_tree", "s", 0.0), ("pick", "x", 0.15)):
    key = ("pick_over_best" if what == "pick" else "auto_over_best") + tail
    pts = [(names.index(f"{r['mode'][0]} b{r['batch']} p{r['prompt_len']}") + dx, r[key])
           for r in rows if (what == "pick" or r["auto"] == what) and r[key] is not None]
    if pts:
      ax.scatter(*zip(*pts), marker=marker, label=what if what != "pick" else
                 "leave-one-run-out pick", alpha=0.7)
  ax.axhline(HOLD, color="grey", ls="--", lw=1)
  ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
  held = result["crossfit"] if cf else result
  ax.set_ylabel("S over the best" + (" (chosen on other rounds)" if cf else ""), fontsize=8)
  ax.set_title(f"{result['runs']} runs: auto holds {held['auto_holds']}/{held['auto_cells']}"
               f", the pick {held['pick_holds']}/{held['pick_cells']}", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("jsons", nargs="+", help="bench_decode JSONs of one model and machine")
  ap.add_argument("--before", nargs="*", default=[], help="older grids to compare with")
  ap.add_argument("--modes", default="greedy,sampled", help="the cells' modes read")
  ap.add_argument("--autos", default=",".join(AUTO), help="the auto variants read")
  ap.add_argument("--json", default=None)
  ap.add_argument("--png", default=None)
  args = ap.parse_args(argv)
  for path in args.jsons + args.before:
    if not os.path.exists(path):
      ap.error(f"jsons: no file {path}")
  modes, autos = args.modes.split(","), args.autos.split(",")
  if set(modes) - {"greedy", "sampled"} or set(autos) - set(AUTO):
    ap.error(f"--modes: greedy and/or sampled, --autos: {' and/or '.join(AUTO)}; got "
             f"{args.modes!r}, {args.autos!r}")
  read = lambda p: {key: {v: r for v, r in cell.items() if v not in AUTO or v in autos}
                    for key, cell in load(p).items() if key[0] in modes}
  runs = [read(p) for p in args.jsons]
  result = summary(runs, [read(p) for p in args.before])
  result["files"] = args.jsons
  result["before_files"] = args.before
  first = next(iter(next(iter(runs[0].values())).values()))
  if "machine" in first:  # the runs' machine, not the one reading them
    result["machine"] = first["machine"]
  common.emit(result, args.json)
  if args.png:
    plot(result, args.png)
  return result


if __name__ == "__main__":
  main()
