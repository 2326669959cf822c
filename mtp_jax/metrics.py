"""One writer for what the training loop reports: a console line, DIR/metrics.jsonl (one JSON
object per write: {"step": ..., "train/loss": ..., "train/head1_loss": ...}) and TensorBoard
event files in DIR (tensorboardX).

    writer = MetricsWriter(workdir, total_steps=steps, tokens_per_step=B * S)
    writer.write(step, "train", metrics)   # metrics: scalars and per-head [N] arrays
    writer.write(step, "eval", metrics)
    writer.close()

`writer.last[kind]` keeps the last flat values of each kind: the loop puts them in summary.json
through `write_summary`, which keeps the record of a finished run when a rerun trains nothing.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any
from collections.abc import Callable

import numpy as np

from mtp_jax import acceptance, hostinfo
from mtp_jax import workdir as workdir_lib

KINDS = ("train", "eval")


def head_summary(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  """Flat, JSON-friendly per-head metrics: loss, head1_loss, head2_acc, ..."""
  out = {}
  for key, value in metrics.items():
    value = np.asarray(value)
    if value.ndim == 1 and key.startswith("head_"):
      for i, v in enumerate(value):
        out[f"{prefix}head{i + 1}_{key[5:]}"] = float(v)
    elif value.ndim == 0:
      out[prefix + key] = float(value)
  return out


def _fmt_heads(values) -> str:
  return " ".join(f"{v:.3f}" for v in np.asarray(values))


def machine() -> dict[str, Any]:
  """The host a run's timings come from (`hostinfo.machine`): CPU model name and the cores this
  process may use."""
  return hostinfo.machine()


def write_summary(path: str, summary: dict[str, Any], *, trained: bool) -> dict[str, Any]:
  """Writes `summary` to `path` (summary.json) and returns what the file holds.

  A call that trained no step (a rerun of a finished run, a resume past `train.stop_at`) has no
  speed, loss or eval of its own: if `path` already records the same step and params, it is kept
  as it was, with only the keys it lacks added from `summary`, so a rerun never loses the run's
  figures."""
  if not trained and os.path.isfile(path):
    try:
      with open(path) as f:
        old = json.load(f)
    except (OSError, ValueError):
      old = None
    if (isinstance(old, dict) and old.get("step") == summary["step"]
        and old.get("params_sha256") == summary["params_sha256"]):
      summary = {**summary, **old}
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(summary, f, indent=2)
  os.replace(tmp, path)  # a kill mid-write leaves the old record, never half a file
  return summary


def summary_writer_class():
  """tensorboardX.SummaryWriter, imported without torch. tensorboardX imports torch wherever it
  is installed, for the type of the tensors it accepts: 1.5-2 s at the start of every run, more
  than the rest of its import, for a writer that gets floats only. `import torch`
  fails inside tensorboardX's import and works again after it; a process that has torch already
  keeps it."""
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # what `import torch` reads as "not installed"
  try:
    from tensorboardX import SummaryWriter
  finally:
    if sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return SummaryWriter


class MetricsWriter:
  """Console, metrics.jsonl and TensorBoard behind one `write(step, kind, values)`."""

  def __init__(self, workdir: str, *, total_steps: int, tokens_per_step: int, out=None,
               mfu: Callable[[float], float | None] | None = None, primary: bool = True):
    """`mfu`: tokens/s -> model FLOPs utilisation (flops.mfu with this run's FLOPs per token and
    peak); train values then carry `mfu` too (console, metrics.jsonl, TensorBoard).
    `primary=False` (every process of a multi-process run but process 0) writes nothing and
    prints nothing, and still keeps `last`."""
    self.mfu = mfu
    self.primary = primary
    self.total_steps = total_steps
    self.tokens_per_step = tokens_per_step
    self.last: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    self._out = out
    self._tb = summary_writer_class()(workdir) if primary else None
    self._jsonl = open(os.path.join(workdir, workdir_lib.METRICS), "a") if primary else None

  def write(self, step: int, kind: str, values: dict[str, Any]):
    """`values` of kind "train" carry `tokens_per_sec` (for the console's ETA)."""
    if kind not in KINDS:
      raise ValueError(f"kind: must be one of {KINDS}, got {kind!r}")
    if kind == "train" and self.mfu is not None and "tokens_per_sec" in values:
      mfu = self.mfu(float(values["tokens_per_sec"]))
      if mfu is not None:
        values = {**values, "mfu": mfu}
    flat = head_summary(values, prefix=f"{kind}/")
    self.last[kind] = flat
    if not self.primary:
      return
    for k, v in flat.items():
      self._tb.add_scalar(k, v, step)
    self._jsonl.write(json.dumps({"step": step, **flat}) + "\n")
    self._jsonl.flush()
    line = self._train_line(step, values) if kind == "train" else self._eval_line(step, values)
    print(line, file=self._out or sys.stdout, flush=True)

  def _train_line(self, step, m) -> str:
    tps = float(m["tokens_per_sec"])
    eta = (self.total_steps - step) * self.tokens_per_step / max(tps, 1e-9)
    skipped = int(m["nonfinite_total"]) if "nonfinite_total" in m else 0
    return (f"step {step}/{self.total_steps} loss {float(m['loss']):.4f} "
            f"heads [{_fmt_heads(m['head_loss'])}] acc1 {float(m['head_acc'][0]):.3f} "
            f"{tps:,.0f} tok/s" + (f" MFU {100 * float(m['mfu']):.1f}%" if "mfu" in m else "")
            + f" ETA {eta:,.0f}s" + (f" skipped {skipped}" if skipped else ""))

  @staticmethod
  def _eval_line(step, m) -> str:
    line = (f"eval step {step}: loss [{_fmt_heads(m['head_loss'])}] acc "
            f"[{_fmt_heads(m['head_acc'])}] agree [{_fmt_heads(m['head_agree'])}]")
    for mode in ("greedy", "sampled"):  # heads 2..n (acceptance.py), with the a they give
      if f"head_alpha_{mode}" in m and len(m[f"head_alpha_{mode}"]) > 1:
        line += f" alpha {mode} [{_fmt_heads(m[f'head_alpha_{mode}'][1:])}]"
        a = acceptance.estimate(m, mode)
        line += "" if a is None else f" a ~ {a:.2f} (estimate)"
    return line

  def close(self):
    if self.primary:
      self._jsonl.close()
      self._tb.close()
