"""Run a scaling-law sweep: one `python -m mtp_jax.train` run per entry of a sweep file.

    python experiments/sweep.py --sweep experiments/sweeps/size_x_n.py --root runs/size_x_n \
        [--parallel 2] [--dry_run] [--set data.corpus=text_folder data.folder=~/src] \
        [--launcher slurm [--slurm_args="-p gpu --gpus=1 --time=4:00:00"] [--no_wait]]

Each run trains in ROOT/NAME (log: ROOT/NAME/train.log). Rerunning skips finished runs and resumes
unfinished ones; a failed run is reported and the others go on. Writes ROOT/sweep.json and
ROOT/results.csv; then `python experiments/analyze_sweep.py ROOT`. Exit status: 0 all runs
finished (or, with --no_wait, submitted), 1 some failed or were interrupted, 2 bad input or a
Slurm command that failed. The logic is in mtp_jax/sweeps/sweep.py; --launcher slurm submits the
runs as one Slurm job array instead of running them here (mtp_jax/sweeps/slurm.py, docs/slurm.md).
"""

from __future__ import annotations

import argparse
import sys

from mtp_jax.sweeps import slurm as slurm_lib
from mtp_jax.sweeps import sweep as sweep_lib


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--sweep", required=True, help="sweep file (BASE_CONFIG, get_runs())")
  ap.add_argument("--root", required=True, help="folder for the runs, sweep.json, results.csv")
  ap.add_argument("--parallel", type=int, default=None, help="runs at once (local, default 1: "
                  "each gets cpus/parallel cores by affinity; slurm: the array's %%P, default "
                  "as the cluster allows)")
  ap.add_argument("--launcher", choices=("local", "slurm"), default="local",
                  help="local: subprocesses here; slurm: one sbatch --array job")
  ap.add_argument("--slurm_args", default="", help="extra sbatch options, e.g. "
                  "--slurm_args=\"-p gpu --gpus=1 --time=4:00:00\" (with =: one option alone "
                  "starts with -)")
  ap.add_argument("--no_wait", action="store_true", help="slurm: return once submitted "
                  "(rerun the same command to follow the array to its end)")
  ap.add_argument("--dry_run", action="store_true", help="print what would run, run nothing")
  ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                  help="overrides for every run, not part of the run names")
  ap.add_argument("--no_pin", action="store_true", help="do not split CPUs between runs")
  args = ap.parse_args()
  try:
    extra = {}
    for kv in args.set:
      if "=" not in kv:
        raise ValueError(f"--set: expected KEY=VALUE, got {kv!r}")
      key, value = kv.split("=", 1)
      extra[key] = value
    sweep = sweep_lib.load_sweep(args.sweep, extra)
    if args.launcher == "slurm":
      record = slurm_lib.run_sweep(sweep, args.root, slurm_args=args.slurm_args,
                                   parallel=args.parallel, wait=not args.no_wait,
                                   dry_run=args.dry_run)
    else:
      record = sweep_lib.run_sweep(sweep, args.root, args.parallel or 1, dry_run=args.dry_run,
                                   pin_cpus=not args.no_pin)
  except (ValueError, slurm_lib.SlurmError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 1
  bad = (sweep_lib.RunStatus.FAILED, sweep_lib.RunStatus.INTERRUPTED)
  return int(any(sweep_lib.RunStatus(r["status"]) in bad for r in record["runs"]))


if __name__ == "__main__":
  sys.exit(main())
