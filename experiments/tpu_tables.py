"""Markdown tables of docs/accelerators_tpu.md, docs/accelerators.md (the GPU tables) and README.md
from the JSONs of plan_memory.py (--target tpu:..., gpu:... and the XLA:CPU estimate) and
bench_accel.py --target:

    python experiments/tpu_tables.py --plans experiments/results/plan_tpu_*.json \\
        experiments/results/plan_7b_n4.json --decode experiments/results/aot_decode_v5e_*.json
    python experiments/tpu_tables.py --update README.md docs/accelerators_tpu.md [--check]

A page holds generated tables between `<!-- tpu_tables ARGS -->` and `<!-- /tpu_tables -->`
(ARGS: this script's --plans / --presets / --decode flags); `--update` writes each block again
from its JSONs, `--check` only says which are stale (exit 1), as
tests/integration/test_docs.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

GIB = 2**30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"(<!-- tpu_tables (.*?) -->\n)(.*?)(<!-- /tpu_tables -->)", re.S)


def _load(path: str) -> dict:
  with open(path if os.path.isabs(path) else os.path.join(ROOT, path)) as f:
    return json.load(f)


def _compiler(d: dict, r: dict) -> str:
  version = r.get("compiler_version") or d.get("compiler_version")
  name = r.get("compiler") or d.get("compiler") or "XLA:CPU"
  return f"{name} ({version})" if version else name


def _target(d: dict, r: dict) -> str:
  return r.get("target") or d.get("target") or f"cpu ({r['devices']} simulated)"


def _short_target(d: dict, r: dict) -> str:
  target = _target(d, r)
  return "cpu, simulated (XLA:CPU)" if target.startswith("cpu") else target


def _tokens_per_s(r: dict) -> float | None:
  seconds = r.get("optimal_seconds")
  return r["batch"] * r["seq_len"] / r["devices"] / seconds if seconds else None


def plan_rows(paths: list[str]) -> list[str]:
  out = ["| config | target | compiler | n_future | peak GiB/chip | of HBM | fits | "
         "step s (compiler) | tokens/s/chip (compiler) | MFU at it |",
         "|---|---|---|---|---|---|---|---|---|---|"]
  for path in paths:
    d = _load(path)
    over = d.get("overrides")
    for r in d["records"]:
      method = r.get("cost_method", "")
      method = "depth-extrapolated" if "extrapolated" in method else "unrolled" if method else ""
      seconds, mfu = r.get("optimal_seconds"), r.get("mfu_at_optimal_seconds")
      tps = _tokens_per_s(r)
      out.append(
          f"| {d['config']}{f' ({len(over)} --set, in the JSON)' if over else ''} | "
          f"{_target(d, r)} | {_compiler(d, r)} | {r['n_future']} | "
          f"{r['peak_bytes'] / GIB:.2f} | {r['hbm_gib']:.4g} | {'yes' if r['fits'] else 'no'} | "
          f"{f'{seconds:.3g} ({method})' if seconds else '-'} | "
          f"{f'{tps:,.0f}' if tps else '-'} | {f'{100 * mfu:.0f}%' if mfu else '-'} |")
  return out


def preset_rows(paths: list[str]) -> list[str]:
  """One row a record, for the README: does the preset fit the slice, and the compiler's
  throughput where it was asked for (plan_memory --cost)."""
  out = ["| preset | target | chips | n_future | GiB/chip (of HBM) | fits | "
         "tokens/s/chip, compiler's estimate | MFU at it |", "|---|---|---|---|---|---|---|---|"]
  for path in paths:
    d = _load(path)
    for r in d["records"]:
      tps, mfu = _tokens_per_s(r), r.get("mfu_at_optimal_seconds")
      out.append(
          f"| {os.path.basename(d['config'])} | {_short_target(d, r)} | {r['devices']} | "
          f"{r['n_future']} | {r['peak_bytes'] / GIB:.1f} ({r['hbm_gib']:.4g}) | "
          f"{'yes' if r['fits'] else 'no'} | {f'{tps:,.0f}' if tps else '-'} | "
          f"{f'{100 * mfu:.0f}%' if mfu else '-'} |")
  return out


def decode_rows(paths: list[str]) -> list[str]:
  """The decode cost model's table; where the compiler gave no time (XLA:GPU), each forward's
  compiled peak memory instead of T1 and Tk, and no S."""
  ds = [_load(p) for p in paths]
  if any(r["T1_estimated"] is None for d in ds for r in d["runs"]):
    return _untimed_decode_rows(ds)
  heads = {(d["compiler"], d.get("compiler_version"), d["target"], d["device_kind"], d["dtype"],
            d["what"], d["acceptance_note"], d["acceptance_from"]) for d in ds}
  out = []
  for compiler, version, target, kind, dtype, what, note, source in sorted(heads, key=str):
    out.append(f"{compiler}{f' ({version})' if version else ''} ({target}, {kind}, {dtype}), "
               f"{what}; a: {note} ({source}).")
  out += ["", "| size | batch | context | T1 us (est.) | Tk us (est.) | Tk/T1 | a_batch (CPU) | "
          "S predicted |", "|---|---|---|---|---|---|---|---|"]
  for d in ds:
    for r in d["runs"]:
      out.append(f"| {r['size']} | {r['batch']} | {r['context']} | "
                 f"{1e6 * r['T1_estimated']:.1f} | {1e6 * r['Tk_estimated']:.1f} | "
                 f"{r['Tk_over_T1']:.2f} | {r['a_batch_measured_on_cpu']:.2f} | "
                 f"{r['S_predicted']:.2f} |")
  return out


def _untimed_decode_rows(ds: list[dict]) -> list[str]:
  out = [f"{d['compiler']} ({d['compiler_version']}) ({d['target']}, {d['device_kind']}, "
         f"{d['dtype']}), {d['what']}." for d in ds]
  out += ["", "| size | batch | context | T1, Tk | peak MiB, 1-token forward | peak MiB, "
          f"{ds[0]['runs'][0]['k']}-token forward | a_batch (CPU) | S predicted |",
          "|---|---|---|---|---|---|---|---|"]
  for d in ds:
    for r in d["runs"]:
      out.append(f"| {r['size']} | {r['batch']} | {r['context']} | none (no cost analysis) | "
                 f"{r['peak_bytes_1'] / 2**20:.1f} | {r['peak_bytes_k'] / 2**20:.1f} | "
                 f"{r['a_batch_measured_on_cpu']:.2f} | - |")
  return out


def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--plans", nargs="*", default=[], help="plan_memory.py JSONs: full table")
  ap.add_argument("--presets", nargs="*", default=[], help="plan_memory.py JSONs: short table")
  ap.add_argument("--decode", nargs="*", default=[], help="bench_accel.py --target JSONs")
  ap.add_argument("--update", nargs="*", default=[], metavar="PAGE",
                  help="rewrite the generated blocks of these pages")
  ap.add_argument("--check", action="store_true", help="with --update: write nothing, exit 1 "
                  "if a block is stale")
  return ap.parse_args(argv)


def tables(args) -> str:
  parts = []
  for rows, paths in ((plan_rows, args.plans), (preset_rows, args.presets),
                      (decode_rows, args.decode)):
    if paths:
      parts.append("\n".join(rows(paths)))
  return "\n\n".join(parts)


def update(page: str, check: bool) -> bool:
  """Regenerates the blocks of `page`; True if they were (or, with check, are) up to date."""
  path = page if os.path.isabs(page) else os.path.join(ROOT, page)
  with open(path, encoding="utf-8") as f:
    text = f.read()
  new = BLOCK.sub(lambda m: m.group(1) + tables(parse_args(shlex.split(m.group(2)))) + "\n"
                  + m.group(4), text)
  if new != text and not check:
    with open(path, "w", encoding="utf-8") as f:
      f.write(new)
  return new == text


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.update:
    stale = [p for p in args.update if not update(p, args.check)]
    if stale:
      print(("stale: " if args.check else "updated: ") + ", ".join(stale), file=sys.stderr)
    return 1 if stale and args.check else 0
  print(tables(args))
  return 0


if __name__ == "__main__":
  sys.exit(main())
