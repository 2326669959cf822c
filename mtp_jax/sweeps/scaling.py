"""A sweep's results: results.csv gathered from its workdirs, power-law fits, and the MTP-gain
table (Gloeckle et al. 2024, §3.1: does multi-token prediction help more as models grow?).

    from mtp_jax.sweeps import scaling
    out = scaling.analyze("runs/size_x_n")     # fits, table; writes PNG, CSV, JSON
    out["fits"]["4"]["params"]                 # {"a": ..., "b": ..., "r2": ..., "points": ...}

Runs are grouped by (n_future, n_params): the sweep is expected to vary model size, n_future and
seed only (parallel heads keep n_params equal across n at one size). Seeds of a group are
averaged; the spread is their standard deviation, and the gain n - 1 is taken seed by seed.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any

import numpy as np

from mtp_jax import config as config_lib
from mtp_jax import workdir as workdir_lib
from mtp_jax.model_args import padded_vocab

# The values of mtp_jax.sweeps.sweep.RunStatus.DONE and .SKIPPED (RunStatus.ok) as sweep.json and
# results.csv hold them; this module reads those files and does not import the sweep runner.
_STATUS_OK = ("done", "skipped")


def read_json(path: str) -> dict | None:
  """A JSON file's object, or None if it is missing or unreadable (a run still writing it)."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _cell(value: Any) -> Any:
  """A CSV cell: blank for None, overrides spelt as on the command line (true, (1, 2))."""
  if value is None:
    return ""
  if isinstance(value, bool):
    return str(value).lower()
  return str(tuple(value)) if isinstance(value, list) else value


def acceptance_proxy(agree: list[float]) -> float:
  """Expected tokens per forward of greedy self-speculative decoding, 1 + a2 + a2*a3 + ..., from
  the teacher-forced agreement a_k of head k's argmax with head 1's (eval/head{k}_agree).

  Assumes head k agrees with head 1 independently of heads 2..k-1 having agreed (the product
  of marginals stands in for the conditional), and teacher-forced contexts for greedy ones.
  Where agreements are positively correlated (a stretch easy for one head is easy for all),
  the product underestimates.
  """
  total, run = 1.0, 1.0
  for a in agree[1:]:
    run *= a
    total += run
  return total


def _embedding_params(config_path: str) -> int | None:
  """Parameters of the embedding (and of the untied output matrix): rows * d_model each, rows
  the vocabulary padded to model.vocab_multiple (config.load_json: a config saved before the
  field existed has no padding). None without the config."""
  if not os.path.isfile(config_path):
    return None
  m = config_lib.load_json(config_path).model
  rows = padded_vocab(m.vocab_size, m.vocab_multiple)
  return rows * m.d_model * (1 if m.tie_embeddings else 2)


def gather_results(root: str) -> list[dict]:
  """One row per run of root/sweep.json, from its summary.json and config.json; writes
  root/results.csv and returns the rows.

  compute = 6 * n_params * tokens_seen, with n_params every parameter (the tied embedding
  counted once, as the unembedding matmul); compute_nonembed the same without the embedding
  (Kaplan et al.'s convention). Both ignore attention's sequence-length term and the extra
  heads' unembedding matmuls.
  """
  record = read_json(os.path.join(root, "sweep.json"))
  if record is None:
    raise ValueError(f"{root}: no sweep.json (run the sweep first)")
  runs = record["runs"]
  keys = list(dict.fromkeys(k for r in runs for k in r["overrides"]))
  summaries = [workdir_lib.read_summary(r["workdir"]) or {} for r in runs]
  max_n = max([int(s.get("n_future", 1)) for s in summaries] + [1])
  per_head = [f"eval/head{k}_{m}" for k in range(1, max_n + 1) for m in ("loss", "acc", "agree")]
  columns = (["name", "status"] + keys + ["head_kind", "n_future", "n_params", "n_params_nonembed",
             "steps", "tokens_seen", "compute", "compute_nonembed", "head1_eval_loss",
             "accept_proxy"] + per_head + ["train/loss", "wall_seconds", "tokens_per_sec"])
  rows = []
  for r, s in zip(runs, summaries):
    row = {"name": r["name"], "status": r["status"], **r["overrides"]}
    if s:
      emb = _embedding_params(workdir_lib.config_path(r["workdir"]))
      n_params, tokens = s["n_params"], s["tokens_seen"]
      row.update({k: s.get(k) for k in ("head_kind", "n_future", "n_params", "tokens_seen",
                                        "train/loss", "wall_seconds", "tokens_per_sec") + tuple(
                                            per_head)})
      row["steps"] = s["step"]
      row["n_params_nonembed"] = None if emb is None else n_params - emb
      row["compute"] = 6.0 * n_params * tokens
      row["compute_nonembed"] = None if emb is None else 6.0 * (n_params - emb) * tokens
      row["head1_eval_loss"] = s.get("eval/head1_loss")
      agree = [s.get(f"eval/head{k}_agree") for k in range(1, s["n_future"] + 1)]
      row["accept_proxy"] = acceptance_proxy(agree) if None not in agree else None
    rows.append(row)
  with open(os.path.join(root, "results.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, columns, extrasaction="ignore")
    w.writeheader()
    for row in rows:
      w.writerow({k: _cell(row.get(k)) for k in columns})
  return rows


def read_results(root_or_csv: str) -> list[dict]:
  """results.csv as dicts, numbers as float (blank = None), other cells as str."""
  path = root_or_csv if root_or_csv.endswith(".csv") else os.path.join(root_or_csv, "results.csv")
  if not os.path.isfile(path) and os.path.isfile(os.path.join(root_or_csv, "sweep.json")):
    gather_results(root_or_csv)
  if not os.path.isfile(path):
    raise ValueError(f"{root_or_csv}: no results.csv (run the sweep first)")

  def cell(v: str):
    if v == "":
      return None
    try:
      return float(v)
    except ValueError:
      return v
  with open(path, newline="") as f:
    return [{k: cell(v) for k, v in row.items()} for row in csv.DictReader(f)]


def ok_rows(rows: list[dict]) -> list[dict]:
  """Rows of runs that finished with a finite head-1 eval loss."""
  return [r for r in rows if r.get("status") in _STATUS_OK
          and isinstance(r.get("head1_eval_loss"), float) and math.isfinite(r["head1_eval_loss"])]


# A line through two points fits them exactly: r² means something from three points on.
MIN_POINTS_FOR_R2 = 3


def fit_power_law(x, y) -> dict[str, float | None]:
  """Least squares in log space, log y = log a + b log x: y ~ a * x**b. Returns a, b, r2 (of the
  log-space fit; None below MIN_POINTS_FOR_R2 points, where it would be 1 whatever the data)
  and the number of points. Needs two distinct positive x and positive y."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.shape != y.shape or x.ndim != 1:
    raise ValueError(f"x and y must be 1-D of one length, got {x.shape} and {y.shape}")
  if np.any(x <= 0) or np.any(y <= 0) or not np.all(np.isfinite(x) & np.isfinite(y)):
    raise ValueError("a power law needs finite, positive x and y")
  if len(np.unique(x)) < 2:
    raise ValueError("a power law needs at least two distinct x")
  lx, ly = np.log(x), np.log(y)
  b, log_a = np.polyfit(lx, ly, 1)
  resid = ly - (log_a + b * lx)
  ss_tot = float(np.sum((ly - ly.mean()) ** 2))
  r2 = 1.0 - float(np.sum(resid ** 2)) / ss_tot if ss_tot > 0 else 1.0
  if len(x) < MIN_POINTS_FOR_R2:
    r2 = None
  return {"a": float(np.exp(log_a)), "b": float(b), "r2": r2, "points": int(len(x))}


def fit_quality(fit: dict[str, Any]) -> str:
  """"r² 0.987, 4 sizes", or why there is none ("2 sizes: too few points for a fit quality")."""
  if fit["r2"] is None:
    return (f"{fit['points']} sizes: too few points for a fit quality (r² needs "
            f">= {MIN_POINTS_FOR_R2})")
  return f"r² {fit['r2']:.3f}, {fit['points']} sizes"


def _std(values) -> float:
  return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _groups(rows: list[dict]) -> dict[tuple[int, int], list[dict]]:
  out: dict[tuple[int, int], list[dict]] = {}
  for r in rows:
    out.setdefault((int(r["n_future"]), int(r["n_params"])), []).append(r)
  return dict(sorted(out.items()))


def _by_seed(group: list[dict]) -> dict[Any, float] | None:
  """seed -> loss, or None when the runs have no distinct seeds to pair by."""
  seeds = [r.get("seed") for r in group]
  if None in seeds or len(set(seeds)) < len(seeds):
    return None
  return {r["seed"]: r["head1_eval_loss"] for r in group}


def gain_table(rows: list[dict]) -> list[dict]:
  """Per model size: mean (± std over seeds) head-1 eval loss for each n, and the gain of each
  n > 1 over n = 1 (negative = MTP better), paired by seed where seeds repeat."""
  groups = _groups(rows)
  ns = sorted({n for n, _ in groups})
  table = []
  for size in sorted({p for _, p in groups}):
    first = next(g for (n, p), g in groups.items() if p == size)[0]
    entry: dict[str, Any] = {"n_params": size}
    for key in ("model.d_model", "model.n_layers"):
      if first.get(key) is not None:
        entry[key.split(".")[1]] = int(first[key])
    by_n = {n: groups.get((n, size), []) for n in ns}
    for n, g in by_n.items():
      losses = [r["head1_eval_loss"] for r in g]
      entry[f"loss_n{n}"] = float(np.mean(losses)) if losses else None
      entry[f"std_n{n}"] = _std(losses) if losses else None
      entry[f"seeds_n{n}"] = len(losses)
    base = _by_seed(by_n.get(1, []))
    for n in ns:
      if n == 1 or not by_n.get(1) or not by_n[n]:
        continue
      other = _by_seed(by_n[n])
      paired = [other[s] - base[s] for s in other if s in base] if base and other else []
      if paired:
        entry[f"gain_n{n}"], entry[f"gain_std_n{n}"] = float(np.mean(paired)), _std(paired)
      else:  # no seeds to pair by: the difference of the means, spread unknown
        entry[f"gain_n{n}"] = entry[f"loss_n{n}"] - entry["loss_n1"]
        entry[f"gain_std_n{n}"] = None
    table.append(entry)
  return table


def markdown(table: list[dict], ns: list[int]) -> str:
  """The gain table as markdown: loss per n (mean ± std over seeds) and n - 1 per size."""
  head = ["n_params", "d_model", "n_layers"] + [f"loss n={n}" for n in ns] + [
      f"n={n} - n=1" for n in ns if n > 1]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

  def pm(mean, std):
    return "" if mean is None else f"{mean:.4f}" + (f" ± {std:.4f}" if std else "")
  for e in table:
    cells = [f"{e['n_params']:,}", str(e.get("d_model", "")), str(e.get("n_layers", ""))]
    cells += [pm(e.get(f"loss_n{n}"), e.get(f"std_n{n}")) for n in ns]
    cells += [pm(e.get(f"gain_n{n}"), e.get(f"gain_std_n{n}")) for n in ns if n > 1]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def fits(rows: list[dict]) -> dict[str, dict[str, Any]]:
  """Per n_future: power laws of the seed-mean head-1 eval loss against n_params and against
  compute (6 N D, results.csv); None where fewer than two sizes finished."""
  groups = _groups(rows)
  out = {}
  for n in sorted({n for n, _ in groups}):
    pts = [(p, np.mean([r["compute"] for r in g]), np.mean([r["head1_eval_loss"] for r in g]))
           for (m, p), g in groups.items() if m == n]
    x_p, x_c, y = (np.array(v, np.float64) for v in zip(*pts))
    out[str(n)] = {}
    for kind, x in (("params", x_p), ("compute", x_c)):
      try:
        out[str(n)][kind] = fit_power_law(x, y)
      except ValueError:
        out[str(n)][kind] = None
  return out


def plot(rows: list[dict], fitted: dict[str, dict[str, Any]]):
  """Figure: head-1 eval loss against parameters and against compute, log-log, one line of points
  (mean ± std over seeds) and its fit per n_future. matplotlib's object API, no pyplot state."""
  from matplotlib import ticker
  from matplotlib.figure import Figure
  groups = _groups(rows)
  fig = Figure(figsize=(11, 4.2), layout="constrained")
  axes = fig.subplots(1, 2)
  for ax, kind, label in ((axes[0], "params", "parameters N"),
                          (axes[1], "compute", "training compute C = 6 N D (FLOPs)")):
    for i, n in enumerate(sorted({n for n, _ in groups})):
      g = [(np.mean([r["n_params" if kind == "params" else "compute"] for r in rs]),
            np.mean([r["head1_eval_loss"] for r in rs]),
            _std([r["head1_eval_loss"] for r in rs])) for (m, _), rs in groups.items() if m == n]
      x, y, e = (np.array(v) for v in zip(*g))
      color = f"C{i}"
      ax.errorbar(x, y, yerr=e, fmt="o", color=color, capsize=3)
      f = fitted[str(n)][kind]
      if f is not None:
        xs = np.geomspace(x.min(), x.max(), 50)
        ax.plot(xs, f["a"] * xs ** f["b"], "--", color=color,
                label=f"n={n}: {f['a']:.3g}·x^{f['b']:.3f} " + (
                    f"(r²={f['r2']:.2f})" if f["r2"] is not None
                    else f"({f['points']} sizes: no fit quality)"))
      else:
        ax.plot([], [], "o", color=color, label=f"n={n}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    for fmt in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
      fmt(ticker.FuncFormatter(lambda v, _: f"{v:g}"))  # losses span less than a decade
    ax.set_xlabel(label)
    ax.set_ylabel("eval loss of head 1 (nats/token)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("Next-token eval loss by model size and number of predicted tokens n")
  return fig


def analyze(root: str, png: str | None = None, json_path: str | None = None,
            csv_path: str | None = None, show=print) -> dict[str, Any]:
  """Fits, gain table and plot of root/results.csv. Writes the PNG (default root/scaling.png),
  the table as CSV (root/mtp_gain.csv) and everything as JSON (root/analysis.json); prints the
  table as markdown through `show`. Returns {"fits", "table", "markdown", "runs", "files"}."""
  rows = ok_rows(read_results(root))
  if not rows:
    raise ValueError(f"{root}: no finished run with an eval loss in results.csv")
  ns = sorted({int(r["n_future"]) for r in rows})
  fitted, table = fits(rows), gain_table(rows)
  md = markdown(table, ns)
  png = png or os.path.join(root, "scaling.png")
  json_path = json_path or os.path.join(root, "analysis.json")
  csv_path = csv_path or os.path.join(root, "mtp_gain.csv")
  for path in (png, json_path, csv_path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  plot(rows, fitted).savefig(png, dpi=120)
  columns = list(dict.fromkeys(k for e in table for k in e))
  with open(csv_path, "w", newline="") as f:
    w = csv.DictWriter(f, columns)
    w.writeheader()
    w.writerows(table)
  out = {"fits": fitted, "table": table, "markdown": md, "runs": len(rows),
         "files": {"png": png, "json": json_path, "csv": csv_path}}
  with open(json_path, "w") as f:
    json.dump(out, f, indent=2, default=str)
  show(md)
  show("(n=k - n=1 < 0: the k-token model's head 1 has the lower eval loss)")
  for n, f in fitted.items():
    for kind in ("params", "compute"):
      if f[kind] is not None:
        show(f"n={n}: loss ~ {f[kind]['a']:.4g} * {kind}^{f[kind]['b']:.4f} "
             f"({fit_quality(f[kind])})")
  return out
