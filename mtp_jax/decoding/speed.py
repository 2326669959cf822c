"""Speed-ups that mean what they say: each mode is timed after its own warm-up call, `reps`
times (at least 3), the calls of the modes interleaved so a change of load hits them alike; the
speed-up is the ratio of medians, and its noise band the lowest and highest ratio of any two
timed calls (min plain / max other, max plain / min other). A ratio whose band holds 1 is
"about the same"; "faster" or "slower" only when every timed call of one mode beat every call
of the other.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

REPS = 3


def time_modes(runs: dict[str, Callable[[], object]], reps: int = REPS) -> dict[str, dict]:
  """{mode: fn()} -> {mode: {"result": the last call's result, "seconds": [each timed call]}}.
  A result with a `seconds` attribute (DecodeResult: the compiled decode alone) gives that
  time; otherwise the call's wall time."""
  if reps < REPS:
    raise ValueError(f"--reps: at least {REPS} timed calls per mode, got {reps}")
  out = {name: {"result": fn(), "seconds": []} for name, fn in runs.items()}  # warm-ups
  for _ in range(reps):
    for name, fn in runs.items():
      t0 = time.perf_counter()
      r = fn()
      wall = time.perf_counter() - t0
      out[name]["result"] = r
      out[name]["seconds"].append(float(getattr(r, "seconds", wall)))
  return out


def compare(base: list[float], other: list[float]) -> dict:
  """Speed-up of `other` over `base` (seconds of their timed calls): median ratio, band,
  verdict ("faster", "slower", "about the same")."""
  ratio = statistics.median(base) / max(statistics.median(other), 1e-12)
  lo = min(base) / max(max(other), 1e-12)
  hi = max(base) / max(min(other), 1e-12)
  verdict = "faster" if lo > 1 else "slower" if hi < 1 else "about the same"
  return {"speedup": ratio, "band": [lo, hi], "verdict": verdict, "reps": len(other),
          "base_seconds": list(base), "seconds": list(other)}


def line(c: dict, what: str = "plain decoding") -> str:
  """'speed-up 1.37x (band 1.30-1.45 over 3 timed calls each: faster than plain decoding)'."""
  lo, hi = c["band"]
  tail = "about the same as" if c["verdict"] == "about the same" else f"{c['verdict']} than"
  return (f"speed-up {c['speedup']:.2f}x (noise band {lo:.2f}-{hi:.2f} over {c['reps']} timed "
          f"calls each, after a warm-up: {tail} {what})")
