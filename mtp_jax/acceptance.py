"""Per-position acceptance alpha_k, the way self-speculative decoding sees it, and the a it
estimates.

alpha_k = P(draft k accepted | drafts 2..k-1 accepted), for the heads k = 2..n that draft (head 1
verifies). Three sources, one meaning:

- greedy, teacher-forced (eval metrics, `loss.summarise`: head_alpha_greedy): on validation
  text, head k's argmax at t against head 1's argmax at t + k - 1 (the same target), counted as
  a chain: the positions where heads 2..k all agreed over those where heads 2..k-1 did. In
  greedy decoding a draft passes exactly when it equals head 1's argmax on the accepted prefix,
  so this is decoding's rule on the data's prefixes instead of the model's own.
- sampled, teacher-forced (head_alpha_sampled): speculative sampling accepts a draft x ~ q with
  probability min(1, p(x) / q(x)), so E[accept] = sum_x min(p, q) = 1 - TV(p, q), with p head 1's
  distribution at t + k - 1 and q head k's at t (`loss.divergence`, computed in the loss's
  per-head scan). Averaged over positions, not conditioned on the earlier drafts.
- measured while decoding (`DecodeResult.alpha_by_position`): from the histogram of drafts
  accepted per cycle, P(>= j passed) / P(>= j - 1 passed).

`leviathan_a`: the expected tokens per cycle these give (Leviathan et al. 2023, eq. 1 with one
alpha per position): 1 + alpha_2 + alpha_2 alpha_3 + ... From teacher-forced alphas it is an
estimate of the measured a, not a bound (`a_estimate_teacher_forced_<mode>`): free-running drafts
see the model's own accepted tokens, not the data's, and acceptance is correlated across
positions and cycles (a row in an easy stretch accepts everything, for many cycles), so the
i.i.d. positions the formula assumes do not hold and the measured a can exceed it (greedy a 2.03
to 2.13 at batch 1 against 1.80 to 1.88 in experiments/results/heads_objectives.json;
docs/decoding.md). Set beside
the measured a (bench_decode, evaluate, the training's eval lines). Records written before the
rename carry it as `a_bound_<mode>`: `estimate` and `renamed` read both.
"""

from __future__ import annotations

import os
import re

import numpy as np

MODES = ("greedy", "sampled")
PNG = "acceptance.png"  # in a training workdir: alpha_k over the run's evals
ESTIMATE = "a_estimate_teacher_forced"  # f"{ESTIMATE}_{mode}": leviathan_a of teacher-forced alphas
LEGACY = "a_bound"  # its old name, in results written before the rename


def renamed(key: str) -> str:
  """A record's key under the estimate's current name (".../a_bound_greedy" ->
  ".../a_estimate_teacher_forced_greedy"); other keys as they are."""
  return re.sub(rf"(^|/){LEGACY}_(?={'|'.join(MODES)})", rf"\g<1>{ESTIMATE}_", key)


def estimate(record: dict, mode: str, prefix: str = "") -> float | None:
  """The teacher-forced estimate of a for `mode` in a record (prefix: "eval/" in a summary),
  under its name or its old one; None where it has neither."""
  for name in (ESTIMATE, LEGACY):
    if f"{prefix}{name}_{mode}" in record:
      return float(record[f"{prefix}{name}_{mode}"])
  return None


def leviathan_a(alphas) -> float:
  """Expected tokens per cycle from alpha_2..alpha_n: 1 + sum_k prod_{j <= k} alpha_j."""
  out, p = 1.0, 1.0
  for a in np.asarray(alphas, np.float64).reshape(-1):
    p *= float(a)
    out += p
  return out


def conditional(at_least) -> np.ndarray:
  """alpha_j = P(>= j drafts passed) / P(>= j - 1), from P(>= j) for j = 1..k-1 (P(>= 0) = 1); 0
  where no cycle got that far."""
  p = np.concatenate([[1.0], np.asarray(at_least, np.float64).reshape(-1)])
  return np.where(p[:-1] > 0, p[1:] / np.where(p[:-1] > 0, p[:-1], 1.0), 0.0)


def from_hist(accepted_hist) -> list[float]:
  """alpha_j, j = 1..k-1, from how many cycles accepted 0..k-1 drafts: cycles that got past
  draft j over those that reached it."""
  h = np.asarray(accepted_hist, np.float64)
  return [round(float(h[j:].sum() / h[j - 1:].sum()), 4) if h[j - 1:].sum() else 0.0
          for j in range(1, len(h))]


def from_metrics(metrics: dict) -> dict:
  """{"alpha_greedy": [...], "a_estimate_teacher_forced_greedy": x, (and _sampled)} for heads
  2..n, from eval metrics holding head_alpha_<mode> arrays (what `loss.summarise` gives); modes
  absent skipped."""
  out = {}
  for mode in MODES:
    if f"head_alpha_{mode}" in metrics:
      alphas = np.asarray(metrics[f"head_alpha_{mode}"], np.float64)[1:]
      out[f"alpha_{mode}"] = [round(float(a), 4) for a in alphas]
      out[f"{ESTIMATE}_{mode}"] = round(leviathan_a(alphas), 4)
  return out


def from_summary(summary: dict, prefix: str = "eval/") -> dict:
  """`from_metrics` of a flat record (summary.json, a metrics.jsonl line): eval/head2_alpha_..."""
  out = {}
  for mode in MODES:
    alphas, k = [], 2
    while f"{prefix}head{k}_alpha_{mode}" in summary:
      alphas.append(summary[f"{prefix}head{k}_alpha_{mode}"])
      k += 1
    if alphas:
      out[f"head_alpha_{mode}"] = [1.0] + alphas
  return from_metrics(out)


def plot_run(workdir: str, metrics_file: str = "metrics.jsonl", min_evals: int = 1) -> str | None:
  """Writes DIR/acceptance.png: alpha_k over the run's evals (greedy solid, sampled dashed) and
  the Leviathan a they give. Returns its path; None where fewer than `min_evals` evals carried
  alphas (training passes 2: a curve, not a dot; `python -m mtp_jax.acceptance DIR` 1)."""
  rows = []
  path = os.path.join(workdir, metrics_file)
  if os.path.isfile(path):
    import json
    with open(path) as f:
      for line in f:
        r = json.loads(line)
        acc = from_summary(r)
        if acc:
          rows.append((r["step"], acc))
  if not rows or len(rows) < min_evals:
    return None
  # matplotlib's object API, no pyplot: a notebook that trains in its kernel keeps its backend
  from matplotlib.figure import Figure
  steps = [s for s, _ in rows]
  fig = Figure(figsize=(10, 3.6))
  ax, bx = fig.subplots(1, 2)
  for mode, style in zip(MODES, ("-", "--")):
    if f"alpha_{mode}" not in rows[-1][1]:
      continue
    for j in range(len(rows[-1][1][f"alpha_{mode}"])):
      ax.plot(steps, [r[f"alpha_{mode}"][j] for _, r in rows], style, marker="o", ms=3,
              color=f"C{j}", label=f"head {j + 2}, {mode}")
    bx.plot(steps, [r[f"{ESTIMATE}_{mode}"] for _, r in rows], style, marker="o", ms=3,
            color="k", label=mode)
  ax.set(xlabel="step", ylabel="alpha_k (teacher-forced)", ylim=(0, 1),
         title="P(draft k accepted | drafts < k accepted)")
  bx.set(xlabel="step", ylabel="1 + a2 + a2 a3 + ...",
         title="tokens per cycle, estimated (Leviathan)")
  for a in (ax, bx):
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
  fig.tight_layout()
  out = os.path.join(workdir, PNG)
  fig.savefig(out, dpi=90)
  return out


if __name__ == "__main__":
  import sys
  if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
    sys.exit("usage: python -m mtp_jax.acceptance WORKDIR  (writes WORKDIR/acceptance.png)")
  written = plot_run(sys.argv[1])
  print(written or f"error: {sys.argv[1]}: no eval in metrics.jsonl carries alpha_k")
  sys.exit(0 if written else 2)
