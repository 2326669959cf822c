"""What `make cpu-bench TAG=name` measured, read back: its row of docs/cpu_speed.md's
machines table and the CPU targets.

    python -m experiments.cpu_bench_report --tag xeon_amx [--json out.json]

Reads the records `make cpu-bench` writes into experiments/results (bench_train_peer_TAG,
bench_decode_hf_TAG, bench_decode_options_TAG, profile_train_TAG; a missing one is named, not
fatal) and prints
- the machine they name (CPU model, vendor / family / model, ISA flags);
- the row of docs/cpu_speed.md's machines table ("The machines") for them, each figure the
  ratio of medians the benchmark prints (training: mtp_jax over PyTorch tokens/s; decoding:
  plain greedy over HF generate);
- each figure against the CPU targets (TARGETS: training >= 1.0x PyTorch at n_future 1 and
  >= 0.9x at 4, greedy decoding >= 2.5x HF generate at batch 1 and >= 1.2x at 8), with the
  same-round median beside it;
- per batch of the decoding options' benchmark, the option set
  `backends.cpu.runtime.decode_compiler_options`
  picks on that CPU (`rule`) and whether another set was faster beyond its quartiles (then the
  rule, e.g. `runtime.YNN_ONE_ROW_CPUS`, is worth revisiting for that CPU);
- the one-core profile's untraced steps, mtp_jax over PyTorch.
The JSON record carries the same, with the records' `machine`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from experiments import common

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RECORDS = ("bench_train_peer", "bench_decode_hf", "bench_decode_options", "profile_train")
# (figure, at least): the CPU targets a machine's row is read against.
TARGETS = {"train n_future 1": 1.0, "train n_future 4": 0.9, "greedy batch 1": 2.5,
           "greedy batch 8": 1.2}


def load(results: str, tag: str) -> dict:
  """name -> the record list of RECORDS found for `tag` (absent names left out)."""
  out = {}
  for name in RECORDS:
    path = os.path.join(results, f"{name}_{tag}.json")
    if os.path.isfile(path):
      with open(path) as f:
        data = json.load(f)
      out[name] = data if isinstance(data, list) else [data]
  return out


ID_LABELS = (("vendor", "cpu_vendor"), ("family", "cpu_family"), ("model", "cpu_model_id"))


def cpu_name(machine: dict, labels=ID_LABELS) -> str:
  """"AMD EPYC (family 25, model 17)": the model name and the ids a record names."""
  ids = [f"{label} {machine[key]}" for label, key in labels if machine.get(key) is not None]
  return machine.get("cpu_model", "?") + (f" ({', '.join(ids)})" if ids else "")


def machine_line(machine: dict) -> str:
  isa = [f for f, on in machine.get("isa", {}).items() if on]
  return (f"{cpu_name(machine)}; {machine.get('cpu_count', '?')} cores; "
          f"{', '.join(isa) or 'no AVX2'}")


def figures(records: dict) -> dict:
  """figure name -> {"ratio": ratio of medians, "same_round": median same-round ratio}."""
  out = {}
  for r in records.get("bench_train_peer", []):
    out[f"train n_future {r['n_future']}"] = {
        "ratio": r["jax_over_torch_tokens_per_sec"],
        "same_round": r["jax_over_torch_same_round_median"]}
  for r in records.get("bench_decode_hf", []):
    plain = r["sides"]["plain"]
    out[f"greedy batch {r['batch']}"] = {"ratio": plain["ratio_to_hf"],
                                         "same_round": plain["ratio_to_hf_same_round"],
                                         "hf_tokens_agree": r["hf_tokens_agree"]}
  return out


def option_verdicts(records: dict) -> list[dict]:
  """Per decoding-options record: the rule's option set, the fastest set, and whether the
  fastest beat the rule's beyond the quartiles of its speed over the baseline (None where the
  run did not measure the rule's set: `--options` without it)."""
  out = []
  for r in records.get("bench_decode_options", []):
    speed = {r["baseline"]: {"median": 1.0, "quartiles": [1.0, 1.0]},
             **r["speed_over_baseline"]}
    best = max(speed, key=lambda k: speed[k]["median"])
    rule = speed.get(r["rule"])
    # Beyond the noise: the best set's lower quartile above the rule's upper one.
    revisit = None if rule is None else speed[best]["quartiles"][0] > rule["quartiles"][1]
    out.append({"batch": r["batch"], "heads": r["heads"], "rule": r["rule"], "fastest": best,
                "fastest_over_rule": None if rule is None else
                round(speed[best]["median"] / rule["median"], 3),
                "revisit_rule": revisit, "tokens_equal": r["tokens_equal"]})
  return out


def profile_ratios(records: dict) -> dict:
  """n_future -> mtp_jax's untraced one-core step over PyTorch's (above 1: mtp_jax faster)."""
  steps = {}
  for r in records.get("profile_train", []):
    steps.setdefault(r["n_future"], {})[r["framework"]] = r["step_ms_untraced"]
  return {n: round(s["torch"] / s["jax"], 3) for n, s in sorted(steps.items())
          if "jax" in s and "torch" in s}


def ratio_text(ratio: float) -> str:
  """As docs/cpu_speed.md writes a ratio: 2 decimals, 1 from 5x up."""
  return f"{ratio:.1f}x" if ratio >= 5 else f"{ratio:.2f}x"


def table_row(tag: str, machine: dict, figs: dict) -> str:
  cell = lambda name: ratio_text(figs[name]["ratio"]) if name in figs else "-"
  isa = machine.get("isa", {})
  kind = ("AVX-512 + AMX" if isa.get("amx_tile") else "AVX-512, no AMX" if isa.get("avx512f")
          else "AVX2 only" if isa.get("avx2") else "no AVX2")
  name = cpu_name(machine, ID_LABELS[1:])
  files = [f"bench_train_peer_{tag}.json", f"bench_decode_hf_{tag}.json"]
  return (f"| {name}, {kind} | {cell('train n_future 1')} | {cell('train n_future 4')} | "
          f"{cell('greedy batch 1')} | {cell('greedy batch 8')} | {', '.join(files)} |")


def report(tag: str, results: str = RESULTS) -> dict:
  records = load(results, tag)
  if not records:
    raise FileNotFoundError(f"--tag: no record of {', '.join(RECORDS)} for {tag!r} in "
                            f"{results} (make cpu-bench TAG={tag} writes them)")
  machine = next(iter(records.values()))[0].get("machine", {})
  figs = figures(records)
  targets = {name: {"at_least": at_least, **figs[name], "met": figs[name]["ratio"] >= at_least}
             for name, at_least in TARGETS.items() if name in figs}
  return {"tag": tag, "machine": machine, "missing": [n for n in RECORDS if n not in records],
          "figures": figs, "targets": targets, "table_row": table_row(tag, machine, figs),
          "decode_options": option_verdicts(records),
          "one_core_jax_over_torch": profile_ratios(records)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--tag", required=True, help="the TAG of `make cpu-bench TAG=...`")
  ap.add_argument("--results", default=RESULTS)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  try:
    rec = report(args.tag, args.results)
  except FileNotFoundError as e:
    ap.error(str(e))
  print(f"machine: {machine_line(rec['machine'])}", file=sys.stderr)
  if rec["missing"]:
    print(f"missing: {', '.join(rec['missing'])}", file=sys.stderr)
  print(f"docs/cpu_speed.md row:\n{rec['table_row']}", file=sys.stderr)
  for name, t in rec["targets"].items():
    print(f"{name}: {t['ratio']:.3f}x (same-round {t['same_round']:.3f}x), target >= "
          f"{t['at_least']}x: {'met' if t['met'] else 'NOT met'}", file=sys.stderr)
  for v in rec["decode_options"]:
    if v["fastest"] == v["rule"]:
      verdict = "the fastest set"
    elif v["revisit_rule"] is None:
      verdict = f"not measured (fastest of those run: {v['fastest']})"
    else:
      verdict = (f"{v['fastest']} faster, {v['fastest_over_rule']}x"
                 + (" (beyond the quartiles: revisit the rule)" if v["revisit_rule"] else
                    " (inside the quartiles)"))
    print(f"decode options, batch {v['batch']}: the rule's set {v['rule']}: {verdict}",
          file=sys.stderr)
  for n, ratio in rec["one_core_jax_over_torch"].items():
    print(f"one core, n_future {n}: mtp_jax {ratio}x PyTorch (untraced steps)", file=sys.stderr)
  common.emit(rec, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
