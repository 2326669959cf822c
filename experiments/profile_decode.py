"""Where a decoding step's time goes on this machine: the compiled greedy loop (`decode.Decoder`,
the program the CLIs and the benchmarks run) profiled op by op.

    python experiments/profile_decode.py --workdir runs/demo --batches 1,8 [--heads 1] \\
        [--prompt_len 32] [--max_new 128] [--reps 10] [--json out/profile_decode.json]

Per batch: the loop timed untraced (`--reps` calls after a warm-up: seconds per forward), then
one call under `jax.profiler.trace`, whose thunk events are matched to the optimised HLO of the
loop's body. Each op of the body gets a class (`dot`: a dot, or a library fusion around one;
`batched dot`: one with batch dimensions, attention's; `reduce`, `scatter`, `copy`, and
`elementwise` for the rest; "(library)" marks YNNPACK / oneDNN fusions), its shape and its
microseconds per call; the record sums them by class. Traced ops run slower than untraced ones
(`traced_over_untraced` says by how much), so read the shares, not the absolute times. Random
prompts of --prompt_len tokens; EOS is ignored (fixed work).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (README, "CPU speed")
  from mtp_jax import runtime
  runtime.apply_cpu_defaults()

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax
import numpy as np

from experiments import common
from mtp_jax import runtime
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.workdir import load_workdir

_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")


def computations(hlo_text: str) -> dict[str, list[str]]:
  """name -> instruction lines of every computation in an HLO module's text."""
  comps, cur = {}, None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m:
      cur = comps.setdefault(m.group(1), [])
    elif line.strip() == "}":
      cur = None
    elif cur is not None:
      cur.append(line)
  return comps


def while_body_ops(hlo_text: str) -> dict[str, dict]:
  """The ops of the (largest) while loop body: name -> {shape, opcode, class, library}."""
  comps = computations(hlo_text)
  bodies = re.findall(r"body=%?([\w.\-]+)", hlo_text)
  if not bodies:
    raise ValueError("no while loop in this program")
  body = max(bodies, key=lambda b: len(comps.get(b, [])))
  ops = {}
  for line in comps[body]:
    m = _INSTR.match(line)
    if not m or m.group(3) in ("get-tuple-element", "bitcast", "constant", "tuple", "parameter"):
      continue
    name, shape, opcode, rest = m.groups()
    called = re.search(r"calls=%?([\w.\-]+)", rest)
    inner = "\n".join(comps.get(called.group(1), [])) if called else ""
    kind = re.search(r"kind=(\w+)", rest)
    library = bool(kind and kind.group(1) == "kCustom") or "ynn" in name or "onednn" in name
    if opcode == "dot" or " dot(" in inner:  # batch dims: attention's per-(row, kv head) GEMMs
      cls = "batched dot" if "lhs_batch_dims" in (rest if opcode == "dot" else inner) else "dot"
    elif opcode in ("reduce", "reduce-window") or " reduce(" in inner or "reduce-window(" in inner:
      cls = "reduce"
    elif opcode == "scatter" or " scatter(" in inner:
      cls = "scatter"
    elif opcode == "copy":
      cls = "copy"
    else:
      cls = "elementwise"
    ops[name] = {"shape": shape, "opcode": opcode, "class": cls, "library": library}
  return ops


def thunk_times(trace_dir: str) -> tuple[dict, dict]:
  """(total microseconds, event count) per event name in a jax.profiler trace."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {trace_dir}")
  with gzip.open(files[0]) as f:
    events = json.load(f)["traceEvents"]
  total, count = collections.defaultdict(float), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      total[e["name"]] += e["dur"]
      count[e["name"]] += 1
  return total, count


def profile_batch(loaded, batch: int, heads: int, prompt_len: int, max_new: int, reps: int,
                  top: int = 25) -> dict:
  dec = decode_lib.Decoder(loaded.params, loaded.model.args, k=heads, batch=batch,
                           prompt_len=prompt_len, max_new_tokens=max_new)
  rng = np.random.default_rng(0)
  vocab = min(loaded.model.args.vocab_size, 256)
  prompts = [rng.integers(3, vocab, size=prompt_len).tolist() for _ in range(batch)]
  call = lambda: dec(prompts, eos_id=-1, pad_id=loaded.tokenizer.pad_id)
  call()
  runs = [call() for _ in range(reps)]
  seconds = float(np.median([r.seconds for r in runs]))
  forwards = runs[0].forwards
  ops = while_body_ops(dec._compiled.as_text())
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      traced = call()
    total, count = thunk_times(d)
  rows, by_class = [], collections.defaultdict(float)
  for name, op in ops.items():
    if name not in total:
      continue
    us = total[name] / max(count[name], 1)
    rows.append({"op": name, **op, "calls": count[name], "us_per_call": round(us, 2)})
    by_class[op["class"] + (" (library)" if op["library"] else "")] += us
  body_us = sum(by_class.values())
  rows.sort(key=lambda r: -r["us_per_call"])
  return {
      "batch": batch, "heads": heads, "prompt_len": prompt_len, "max_new_tokens": max_new,
      "reps": reps, "forwards": forwards, "seconds_median": seconds,
      "us_per_forward_untraced": round(seconds / forwards * 1e6, 1),
      "us_per_cycle_traced_ops": round(body_us, 1),
      "traced_over_untraced": round(traced.seconds / seconds, 2),
      "ops_in_body": len(ops), "ops_timed": len(rows),
      "us_per_cycle_by_class": {k: round(v, 1) for k, v in
                                sorted(by_class.items(), key=lambda kv: -kv[1])},
      "share_by_class": {k: round(v / body_us, 3) for k, v in
                         sorted(by_class.items(), key=lambda kv: -kv[1])} if body_us else {},
      "top_ops": rows[:top],
      "compile_options": runtime.decode_compiler_options(batch),
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--batches", default="1,8")
  p.add_argument("--heads", type=int, default=1, help="1: plain greedy decoding")
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--max_new", type=int, default=128)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--top", type=int, default=25, help="ops listed per batch")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  try:
    batches = [int(b) for b in args.batches.split(",")]
  except ValueError:
    p.error(f"--batches: comma-separated positive integers, got {args.batches!r}")
  if min(batches) < 1 or args.reps < 1 or args.max_new < 2 or args.prompt_len < 1:
    p.error("--batches, --reps and --prompt_len must be >= 1 and --max_new >= 2")
  if not os.path.isdir(args.workdir):
    p.error(f"--workdir: no such directory: {args.workdir}")
  loaded = load_workdir(args.workdir)
  records = []
  for b in batches:
    rec = profile_batch(loaded, b, args.heads, args.prompt_len, args.max_new, args.reps,
                        args.top)
    rec.update(workdir=args.workdir, xla_flags=os.environ.get("XLA_FLAGS", ""))
    records.append(rec)
    print(json.dumps({k: rec[k] for k in ("batch", "us_per_forward_untraced",
                                          "traced_over_untraced", "share_by_class")}),
          flush=True)
  common.emit(records, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
