"""Markdown tables of docs/accelerators_tpu.md from the JSONs of plan_memory.py (--target
tpu:... and the XLA:CPU estimate) and bench_accel.py --target:

    python experiments/tpu_tables.py --plans experiments/results/plan_tpu_*.json \\
        experiments/results/plan_7b_n4.json --decode experiments/results/aot_decode_v5e.json
"""

from __future__ import annotations

import argparse
import json

GIB = 2**30


def plan_rows(paths: list[str]) -> list[str]:
  out = ["| config | target | compiler | n_future | peak GiB/chip | of HBM | fits | "
         "step s (compiler) | MFU at it |", "|---|---|---|---|---|---|---|---|---|"]
  for path in paths:
    with open(path) as f:
      d = json.load(f)
    over = d.get("overrides")
    for r in d["records"]:
      method = r.get("cost_method", "")
      method = "depth-extrapolated" if "extrapolated" in method else "unrolled" if method else ""
      target = r.get("target") or d.get("target") or f"cpu ({r['devices']} simulated)"
      seconds = r.get("optimal_seconds")
      mfu = r.get("mfu_at_optimal_seconds")
      out.append(
          f"| {d['config']}{f' ({len(over)} --set, in the JSON)' if over else ''} | "
          f"{target} | {r.get('compiler', 'XLA:CPU')} | {r['n_future']} | "
          f"{r['peak_bytes'] / GIB:.2f} | {r['hbm_gib']:g} | {'yes' if r['fits'] else 'no'} | "
          f"{f'{seconds:.3g} ({method})' if seconds else '-'} | "
          f"{f'{100 * mfu:.0f}%' if mfu else '-'} |")
  return out


def decode_rows(path: str) -> list[str]:
  with open(path) as f:
    d = json.load(f)
  out = [f"{d['compiler']} ({d['target']}, {d['device_kind']}, {d['dtype']}), {d['what']}; "
         f"a: {d['acceptance_note']} ({d['acceptance_from']}).", "",
         "| size | batch | T1 us (est.) | Tk us (est.) | Tk/T1 | a_batch (CPU) | S predicted |",
         "|---|---|---|---|---|---|---|"]
  for r in d["runs"]:
    out.append(f"| {r['size']} | {r['batch']} | {1e6 * r['T1_estimated']:.1f} | "
               f"{1e6 * r['Tk_estimated']:.1f} | {r['Tk_over_T1']:.2f} | "
               f"{r['a_batch_measured_on_cpu']:.2f} | {r['S_predicted']:.2f} |")
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--plans", nargs="*", default=[])
  ap.add_argument("--decode", default="")
  args = ap.parse_args(argv)
  if args.plans:
    print("\n".join(plan_rows(args.plans)) + "\n")
  if args.decode:
    print("\n".join(decode_rows(args.decode)))


if __name__ == "__main__":
  main()
