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
- Plain decoding against itself: auto's S where it chose plain decoding, the spread of one S.
- --before: older grids (say, before a change to auto) compared with these: auto's log(S over
  the best) by Welch's t-test, and the cells holding HOLD by Fisher's exact test.

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
from experiments.decode_calibration import HOLD, candidate_off_by

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


def against_best(runs: list[dict]) -> list[dict]:
  """Per run, cell and auto variant: auto's S over the cell's best S, and the leave-one-run-out
  pick's (None with one run)."""
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
          out.append({"run": i, "mode": key[0], "batch": key[1], "prompt_len": key[2],
                      "auto": v, "chose": cell[v]["heads"], "S": cell[v]["S_measured"],
                      "auto_over_best": cell[v]["S_measured"] / best, "pick": pick,
                      "pick_over_best": None if pick is None else fixed[pick] / best})
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
  if before:
    old = against_best(before)
    log = lambda rs: [np.log(r["auto_over_best"]) for r in rs]
    held = _holds(old, "auto_over_best")
    table = [[out["auto_holds"], len(rows) - out["auto_holds"]], [held, len(old) - held]]
    out["before"] = {"runs": len(before), "auto_holds": held, "auto_cells": len(old),
                     "auto_over_best_mean": float(np.mean([r["auto_over_best"] for r in old])),
                     "welch_p": float(stats.ttest_ind(log(rows), log(old), equal_var=False).pvalue),
                     "fisher_p": float(stats.fisher_exact(table).pvalue)}
  return out


def plot(result: dict, path: str) -> None:
  """auto's S over the best (and the leave-one-run-out pick's) per cell, one point a run."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = result["cells"]
  names = list(dict.fromkeys(f"{r['mode'][0]} b{r['batch']} p{r['prompt_len']}" for r in rows))
  fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names)), 3.5))
  for what, marker, dx in (("auto", "o", -0.15), ("auto_tree", "s", 0.0), ("pick", "x", 0.15)):
    key = "pick_over_best" if what == "pick" else "auto_over_best"
    pts = [(names.index(f"{r['mode'][0]} b{r['batch']} p{r['prompt_len']}") + dx, r[key])
           for r in rows if (what == "pick" or r["auto"] == what) and r[key] is not None]
    if pts:
      ax.scatter(*zip(*pts), marker=marker, label=what if what != "pick" else
                 "leave-one-run-out pick", alpha=0.7)
  ax.axhline(HOLD, color="grey", ls="--", lw=1)
  ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
  ax.set_ylabel("S over the cell's best")
  ax.set_title(f"{result['runs']} runs: auto holds {result['auto_holds']}/{result['auto_cells']}"
               f", the pick {result['pick_holds']}/{result['pick_cells']}", fontsize=9)
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
