"""Small-task accuracy against model size for n_future = 1, 2, 4 (Gloeckle et al. 2024 §4).

Induction and polynomial arithmetic, parallel heads at matched parameters (n_layers counts the
head blocks, so every n has the same parameter count at a size).

    python experiments/small_tasks.py --root runs/small_tasks \\
        --json experiments/results/small_tasks.json --png experiments/results/small_tasks.png

Each run is `python -m mtp_jax.train --config configs/<task>.py --workdir
ROOT/<task>/d<size>_n<N>_s<seed>` with the size, n_future, steps and seed as --config overrides,
run by mtp_jax.sweeps.sweep (console in the workdir's train.log; --parallel P runs at once, each on
1/P of the CPU cores). A finished run is skipped, an unfinished one resumes, a failed one is
reported and the others go on. Each workdir is then scored by `mtp_jax.evaluation.tasks_eval` on
single unpacked examples (cached in task_eval.json): induction accuracy at the recurring names,
polynomial exact match in distribution (validation) and out of it (test_ood). Prints a markdown
table; --json and --png write the records and one panel per task and split.

A size is a d_model ("64": attention heads of 32, d_ff = 3 d_model, the config's n_layers) or
"DxL" (L blocks). --seeds changes model init and data order; the task data stay the same.
--override FIELD=VALUE passes another --config override to every run, TASK:FIELD=VALUE to one
task's runs (e.g. polynomial:data.poly_ops=-).

The defaults (2 tasks x sizes 32, 64 x n_future 1, 2, 4, 300 steps: 12 runs) come to about 24
min on 2 CPU cores shared with other jobs, extrapolated from single runs there: 83-98 s at
d_model 32, 136-162 s at 64, data build, compile and scoring included. At that budget the
polynomial task stays at chance (see configs/polynomial.py); it needs thousands of --steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from experiments import common
from mtp_jax.sweeps import scaling
from mtp_jax.sweeps import sweep as sweep_lib
from mtp_jax import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (task, split, metric, panel title)
PANELS = [("induction", "validation", "acc", "induction: accuracy at recurring names"),
          ("polynomial", "validation", "exact", "polynomial: exact match, in distribution"),
          ("polynomial", "test_ood", "exact", "polynomial: exact match, more operations (OOD)")]


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v.strip()]


def size_overrides(size: str) -> dict:
  """"64" -> d_model 64, 2 heads of 32, d_ff 192; "64x4" also sets n_layers 4."""
  d, _, layers = size.partition("x")
  d_model = int(d)
  heads = max(1, d_model // 32)
  out = {"model.d_model": d_model, "model.n_heads": heads, "model.n_kv_heads": heads,
         "model.d_ff": 3 * d_model}
  if layers:
    out["model.n_layers"] = int(layers)
  return out


def task_overrides(items: list[str], task: str) -> dict:
  """The FIELD=VALUE items for every task, and the TASK:FIELD=VALUE ones of this task."""
  out = {}
  for item in items:
    key, value = item.split("=", 1)
    scope, _, field = key.rpartition(":")
    if scope in ("", task):
      out[field] = value
  return out


def task_scores(workdir: str, limit: int | None) -> dict:
  """tasks_eval.score_workdir, cached in workdir/task_eval.json for this step and limit."""
  from mtp_jax.evaluation import tasks_eval
  path = os.path.join(workdir, "task_eval.json")
  step = workdir_lib.read_summary(workdir)["step"]
  cached = scaling.read_json(path)
  if cached and cached["step"] == step and cached.get("limit") == limit:
    return cached
  result = dict(tasks_eval.score_workdir(workdir, limit=limit), limit=limit)
  with open(path, "w") as f:
    json.dump(common.stamp(result), f, indent=2)
  return result


def task_sweep(task: str, args) -> sweep_lib.Sweep:
  """One task's grid as a sweep: configs/<task>.py, runs named d<size>_n<N>_s<seed>."""
  common = {"train.steps": args.steps, "train.eval_every": args.steps,
            "train.checkpoint_every": args.steps, **task_overrides(args.override, task)}
  runs = [sweep_lib.Run(f"d{size}_n{n}_s{seed}",
                        {**size_overrides(size), "model.n_future": n, "seed": seed,
                         "data.shuffle_seed": seed})
          for size in args.sizes for n in args.n_future for seed in args.seeds]
  return sweep_lib.Sweep(f"small_tasks:{task}", os.path.join(ROOT, "configs", f"{task}.py"),
                         common, runs)


def run_grid(args) -> list[dict]:
  """Trains each task's grid with mtp_jax.sweeps.sweep (skip finished, resume, report failures,
  --parallel runs at once), then scores every finished run: all training first, so this process
  imports jax only after its last subprocess started."""
  trained = []
  for task in args.tasks:
    print(f"== {task}", flush=True)
    sweep = task_sweep(task, args)
    record = sweep_lib.run_sweep(sweep, os.path.join(args.root, task), parallel=args.parallel)
    trained += [(task, run, r["workdir"]) for run, r in zip(sweep.runs, record["runs"])
                if sweep_lib.RunStatus(r["status"]).ok]
  records = []
  for task, run, workdir in trained:
    size, n, seed = (run.name[1:].split("_n")[0], run.overrides["model.n_future"],
                     run.overrides["seed"])
    summary = workdir_lib.read_summary(workdir)
    ev = task_scores(workdir, args.eval_limit)
    records.append({"task": task, "size": size, "n_future": n, "seed": seed, "workdir": workdir,
                    "n_params": summary["n_params"], "step": summary["step"],
                    "train_seconds": summary["wall_seconds"], "eval": ev})
    print(f"{task} size {size} n_future {n} seed {seed}: " + ", ".join(
        f"{split} {m} {ev[split][m]:.3f}" for t, split, m, _ in PANELS if t == task), flush=True)
  return records


def aggregate(records: list[dict]) -> dict:
  """{(task, split, metric): {(size, n): [values over seeds]}}, with n_params per size."""
  out = {}
  for rec in records:
    for task, split, metric, _ in PANELS:
      if rec["task"] == task:
        out.setdefault((task, split, metric), {}).setdefault(
            (rec["size"], rec["n_future"]), []).append(rec["eval"][split][metric])
  return out


def table(records: list[dict], sizes: list[str], ns: list[int]) -> str:
  agg = aggregate(records)
  params = {(r["task"], r["size"]): r["n_params"] for r in records}
  lines = ["| task | split | size | params | " + " | ".join(f"n={n}" for n in ns) + " |",
           "|---|---|---|---|" + "---|" * len(ns)]
  for (task, split, metric), cells in agg.items():
    for size in sizes:
      row = []
      for n in ns:
        v = cells.get((size, n))
        spread = f" ± {np.std(v, ddof=1):.3f}" if v and len(v) > 1 else ""  # sample std
        row.append("" if not v else f"{np.mean(v):.3f}" + spread)
      if any(row):
        lines.append(f"| {task} | {split} {metric} | {size} | {params[(task, size)]:,} | "
                     + " | ".join(row) + " |")
  return "\n".join(lines)


def plot(records: list[dict], ns: list[int], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  agg = aggregate(records)
  panels = [p for p in PANELS if p[:3] in agg]
  fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
  for ax, (task, split, metric, title) in zip(axes[0], panels):
    cells = agg[(task, split, metric)]
    params = {r["size"]: r["n_params"] for r in records if r["task"] == task}
    for n in ns:
      pts = sorted((params[size], np.mean(v), np.std(v, ddof=1) if len(v) > 1 else 0.0)
                   for (size, m), v in cells.items() if m == n)
      if pts:
        x, y, e = map(np.asarray, zip(*pts))
        ax.errorbar(x, y, yerr=e if (e > 0).any() else None, marker="o", capsize=3,
                    label=f"n={n}")
    if task == "induction":
      ax.axhline(1 / 26, color="gray", ls=":", label="chance")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--root", default="runs/small_tasks", help="workdirs go under ROOT/<task>/")
  ap.add_argument("--tasks", default="induction,polynomial")
  ap.add_argument("--sizes", default="32,64", help="d_model values, or DxL with L blocks")
  ap.add_argument("--n_future", default="1,2,4")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--seeds", default="0")
  ap.add_argument("--parallel", type=int, default=1,
                  help="runs at once; on a CPU each gets 1/P of the cores (mtp_jax.sweeps.sweep)")
  ap.add_argument("--eval_limit", type=int, default=None, help="examples per split (all)")
  ap.add_argument("--override", action="append", default=[],
                  help="another --config override, [TASK:]FIELD=VALUE (e.g. data.dir=/tmp/ds)")
  ap.add_argument("--json", default=None, help="write the records here")
  ap.add_argument("--png", default=None, help="write the figure here")
  args = ap.parse_args(argv)
  args.tasks = [t for t in args.tasks.split(",") if t]
  unknown = [t for t in args.tasks if t not in ("induction", "polynomial")]
  if unknown:
    ap.error(f"--tasks: unknown {unknown}, allowed: induction, polynomial")
  args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
  args.n_future, args.seeds = _ints(args.n_future), _ints(args.seeds)
  bad = [kv for kv in args.override if "=" not in kv
         or kv.split("=")[0].rpartition(":")[0] not in ("", "induction", "polynomial")]
  if bad:
    ap.error(f"--override: expected [TASK:]FIELD=VALUE, got {bad}")

  t0 = time.time()
  records = run_grid(args)
  print()
  print(table(records, args.sizes, args.n_future))
  secs = time.time() - t0
  print(f"\n{len(records)} runs scored in {int(secs // 60)}m{int(secs % 60):02d}s")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(common.stamp({"args": {k: v for k, v in vars(args).items()},
                               "runs": records}), f, indent=2)
    print(f"wrote {args.json}")
  if args.png and records:
    plot(records, args.n_future, args.png)
  return 0 if len(records) == len(args.tasks) * len(args.sizes) * len(args.n_future) * len(
      args.seeds) else 1


if __name__ == "__main__":
  sys.exit(main())
