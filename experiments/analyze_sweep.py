"""Power-law fits and the MTP-gain table of a finished (or partly finished) sweep.

    python experiments/analyze_sweep.py ROOT [--png PATH] [--json PATH] [--csv PATH]

Reads ROOT/results.csv (gathered again from the workdirs first, so it reflects runs finished since
the sweep last wrote it); per n_future, fits head-1 eval loss ~ a * N^b against parameters and
against compute; prints the table of (n=max minus n=1) head-1 eval loss per model size as
markdown; writes the PNG (ROOT/scaling.png), the table (ROOT/mtp_gain.csv) and everything as
JSON (ROOT/analysis.json). The logic is in mtp_jax/sweeps/scaling.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from mtp_jax.sweeps import scaling
from mtp_jax.sweeps import sweep as sweep_lib


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("root", help="the sweep's --root")
  ap.add_argument("--png", default=None, help="default ROOT/scaling.png")
  ap.add_argument("--json", default=None, help="default ROOT/analysis.json")
  ap.add_argument("--csv", default=None, help="the gain table; default ROOT/mtp_gain.csv")
  args = ap.parse_args()
  try:
    if os.path.isfile(os.path.join(args.root, "sweep.json")):
      sweep_lib.gather_results(args.root)
    out = scaling.analyze(args.root, png=args.png, json_path=args.json, csv_path=args.csv)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print("wrote " + ", ".join(out["files"].values()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
