"""Speed-ups that mean what they say: each mode is timed after its own warm-up call, `reps`
times (at least 3), the calls of the modes interleaved so a change of load hits them alike, and
each round started one mode later, so that no mode always runs after the same other one (two
compilations of one program once measured 0.75 apart, one of them always timed right after a
tree decoder; which of the two caused it was not settled); the
speed-up is the ratio of medians, and its noise band the lowest and highest ratio of any two
timed calls (min plain / max other, max plain / min other). A ratio whose band holds 1 is
"about the same"; "faster" or "slower" only when every timed call of one mode beat every call
of the other. The band widens as calls are added; `ci`, a 95% bootstrap interval of the median
of the calls' paired ratios (call i of one mode against call i of the other, timed side by
side), narrows: what judging one variant against another within +-10% needs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

REPS = 3


def time_modes(runs: dict[str, Callable[[], object]], reps: int = REPS,
               on_round: Callable[[int], None] | None = None) -> dict[str, dict]:
  """{mode: fn()} -> {mode: {"result": the last call's result, "seconds": [each timed call],
  "forwards", "tokens_per_forward": [each timed call's, where its result has them]}}. A result
  with a `seconds`
  attribute (DecodeResult: the compiled decode alone) gives that time; otherwise the call's wall
  time. on_round(i), if given, runs before timed round i (say, to set round i's sampling seed
  for every mode alike)."""
  if reps < REPS:
    raise ValueError(f"--reps: at least {REPS} timed calls per mode, got {reps}")
  out = {name: {"result": fn(), "seconds": [], "forwards": [], "tokens_per_forward": []}
         for name, fn in runs.items()}  # warm-ups
  names = list(runs)
  for i in range(reps):  # each round starts one mode later: none always runs first (each
    # follows the same one except at a round's start; a shuffled order measured no different)
    if on_round is not None:
      on_round(i)
    for name in names[i % len(names):] + names[:i % len(names)]:
      fn = runs[name]
      t0 = time.perf_counter()
      r = fn()
      wall = time.perf_counter() - t0
      out[name]["result"] = r
      out[name]["seconds"].append(float(getattr(r, "seconds", wall)))
      for what in ("forwards", "tokens_per_forward"):
        if hasattr(r, what):
          out[name][what].append(float(getattr(r, what)))
  return out


def compare(base: list[float], other: list[float]) -> dict:
  """Speed-up of `other` over `base` (seconds of their timed calls): median ratio, band,
  verdict ("faster", "slower", "about the same")."""
  ratio = statistics.median(base) / max(statistics.median(other), 1e-12)
  lo = min(base) / max(max(other), 1e-12)
  hi = max(base) / max(min(other), 1e-12)
  verdict = "faster" if lo > 1 else "slower" if hi < 1 else "about the same"
  return {"speedup": ratio, "band": [lo, hi], "ci": paired_ci(base, other), "verdict": verdict,
          "reps": len(other), "base_seconds": list(base), "seconds": list(other)}


def paired_ci(base: list[float], other: list[float], level: float = 0.95,
              draws: int = 2000) -> list[float]:
  """[lo, hi]: the `level` bootstrap interval of the median of base[i] / other[i] (calls timed
  side by side, so a change of load hits both), resampling the pairs; fixed seed."""
  return _bootstrap(base, other, lambda b, o: np.median(b / np.maximum(o, 1e-12), axis=1),
                    level, draws)


def ratio_ci(base: list[float], other: list[float], level: float = 0.95,
             draws: int = 2000) -> list[float]:
  """[lo, hi]: the same pairs resampled, the interval of median(base) / median(other): the
  ratio of medians that `compare`'s speed-up is (`paired_ci` is the median of the ratios)."""
  return _bootstrap(base, other, lambda b, o: np.median(b, axis=1) / np.maximum(
      np.median(o, axis=1), 1e-12), level, draws)


def _bootstrap(base, other, stat, level, draws) -> list[float]:
  """The `level` interval of stat(base rows, other rows) over `draws` resamplings of the pairs
  (base[i], other[i]); fixed seed."""
  n = min(len(base), len(other))
  b, o = np.asarray(base[:n], float), np.asarray(other[:n], float)
  idx = np.random.default_rng(0).integers(0, n, (draws, n))
  got = stat(b[idx], o[idx])
  q = (1 - level) / 2
  return [float(np.quantile(got, q)), float(np.quantile(got, 1 - q))]


def line(c: dict, what: str = "plain decoding") -> str:
  """'speed-up 1.37x (band 1.30-1.45 over 3 timed calls each: faster than plain decoding)'."""
  lo, hi = c["band"]
  tail = "about the same as" if c["verdict"] == "about the same" else f"{c['verdict']} than"
  return (f"speed-up {c['speedup']:.2f}x (noise band {lo:.2f}-{hi:.2f} over {c['reps']} timed "
          f"calls each, after a warm-up: {tail} {what})")
