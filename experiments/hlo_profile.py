"""Reading a jax.profiler trace of XLA:CPU against the program's optimised HLO: every thunk
event is an HLO instruction of the program, so its time can be put beside the instruction's
shape and op class (experiments/profile_decode.py, experiments/profile_train.py).

A thunk's event lasts as long as the thunk runs on its thread. An Eigen dot that XLA runs
asynchronously (large ones, on the intra-op pool) ends its event at dispatch, and its time
shows up in the ops that wait for it: a train step's [2048, 256] x [256, 1536] dot (1.6
GFLOP) read 377 us, the elementwise fusion after it 6.3 ms. Compare the traced ops' sum with
the untraced run (`coverage` in profile_decode's records) before reading shares.

Classes: `attention dot` (q k^T and p v: a dot of mtp_jax/attention.py's einsums, or a fusion
around one, forward or backward), `dot` (every other dot: the weights'), `reduce`, `scatter`,
`copy` (copies and transposes), `loop` (a while loop, conditional or call run as one op: its
body's time, e.g. the loss's scan over heads in a train step), `elementwise` (every other
fusion); "(library)" marks YNNPACK / oneDNN fusions and the MKL GEMMs of model.cpu_matmul
(mtp_jax/backends/cpu/gemm.py's custom call).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

# mtp_jax/attention.py's einsums (q k^T and p v, forward or transposed), named in op_name: an
# einsum of the attention module over the key axis t; its projections' ("...f,fg->...g") have none.
ATTENTION_EINSUM = re.compile(r'op_name="[^"]*/attention/[a-z,]*t[a-z,]*->[a-z]+/')
# a shape is one token or a tuple "(s32[], f32[4]{0}, /*index=2*/...)" (while loops, multi-output
# fusions)
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$")
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


def entry_name(hlo_text: str) -> str:
  """The name of an HLO module's ENTRY computation (a train step's ops, none in a loop)."""
  m = re.search(r"^ENTRY %?([\w.\-]+)", hlo_text, re.M)
  if not m:
    raise ValueError("no ENTRY computation in this HLO text")
  return m.group(1)


def while_body_ops(hlo_text: str) -> dict[str, dict]:
  """The ops of the (largest) while loop body: name -> {shape, opcode, class, library}."""
  comps = computations(hlo_text)
  bodies = re.findall(r"body=%?([\w.\-]+)", hlo_text)
  if not bodies:
    raise ValueError("no while loop in this program")
  return classify(comps[max(bodies, key=lambda b: len(comps.get(b, [])))], comps)


def classify(lines: list[str], comps: dict[str, list[str]]) -> dict[str, dict]:
  """name -> {shape, opcode, class, library} of the instruction lines of one computation."""
  ops = {}
  for line in lines:
    m = _INSTR.match(line)
    if not m or m.group(3) in ("get-tuple-element", "bitcast", "constant", "tuple", "parameter"):
      continue
    name, shape, opcode, rest = m.groups()
    called = re.search(r"calls=%?([\w.\-]+)", rest)
    inner = "\n".join(comps.get(called.group(1), [])) if called else ""
    kind = re.search(r"kind=(\w+)", rest)
    library = bool(kind and kind.group(1) == "kCustom") or "ynn" in name or "onednn" in name
    if opcode in ("while", "conditional", "call"):
      cls = "loop"  # its body's ops inside its event (the loss's scan over heads)
    elif opcode == "custom-call" and 'custom_call_target="mtp_jax_sgemm"' in rest:
      cls, library = "dot", True  # model.cpu_matmul's MKL sgemm (backends.cpu.gemm.TARGET)
    elif opcode == "dot" or " dot(" in inner:
      text = rest if opcode == "dot" else inner
      # a dot XLA rewrote may have lost its op_name: batched, it is attention's (the weights'
      # batched dots, vmapped heads, keep theirs)
      attention = ATTENTION_EINSUM.search(text) or (
          "op_name=" not in text and "lhs_batch_dims" in text)
      cls = "attention dot" if attention else "dot"
    elif opcode in ("reduce", "reduce-window") or " reduce(" in inner or "reduce-window(" in inner:
      cls = "reduce"
    elif opcode == "scatter" or " scatter(" in inner:
      cls = "scatter"
    elif opcode in ("copy", "transpose") or (
        inner.count(" = ") <= 3 and (" copy(" in inner or " transpose(" in inner)):
      cls = "copy"  # a copy or transpose, or a small fusion around one
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


def by_class(ops: dict[str, dict], total: dict, count: dict, top: int = 25) -> dict:
  """The timed ops of `ops` (thunk totals and counts from `thunk_times`): microseconds per
  call of each, summed per class ("(library)" appended for library fusions) as us per program
  run (`runs`: the fewest calls of any timed op, 1 for a program run once), shares, top ops."""
  rows, sums = [], collections.defaultdict(float)
  timed = [n for n in ops if n in total]  # each has at least one event
  runs = min((count[n] for n in timed), default=1)
  for name in timed:
    op = ops[name]
    rows.append({"op": name, **op, "calls": count[name],
                 "us_per_call": round(total[name] / count[name], 2)})
    sums[op["class"] + (" (library)" if op["library"] else "")] += total[name] / runs
  all_us = sum(sums.values())
  rows.sort(key=lambda r: -r["us_per_call"] * r["calls"])
  order = sorted(sums.items(), key=lambda kv: -kv[1])
  return {"ops_timed": len(rows), "us_by_class": {k: round(v, 1) for k, v in order},
          "share_by_class": {k: round(v / all_us, 3) for k, v in order} if all_us else {},
          "us_timed_ops": round(all_us, 1), "top_ops": rows[:top]}
