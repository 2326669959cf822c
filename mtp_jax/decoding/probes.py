"""auto's probes (`session.Session`): a window's own decoding loop run on the call's prompts and
timed, read for its seconds per cycle, the call's fixed part and its acceptance (`run`), and
what the on-disk timing cache keeps of one (`to_entry`, `from_entry`)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from mtp_jax.decoding import costmodel
from mtp_jax.decoding.decoder import Decoder

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Probe:
  """What a probe's decode result is read for, as the disk cache keeps it."""
  rows_hist: np.ndarray
  forwards: int
  tokens_per_forward: float


def run(params, args, prompts, windows, *, rounds: int, max_new_tokens, sampling, eos_id, pad_id,
        sample_kw) -> list:
  """[(result, seconds per cycle, seconds besides the cycles)] of each window, (tree, k) (tree
  None: the chain of k), on the call's prompts. Timed, after a short run of each: `rounds`
  rounds, each running every window's two `costmodel.probe_lengths` runs, a short one and the
  whole call (interleaved, so the windows' cycles see the same moments: S is their ratio), read
  for a cycle and the call's fixed part by `costmodel.cycle_and_fixed` (the fixed part: its
  prefill, the call itself: with 128 new tokens at 0.3 ms a plain step, a prefill of 256 tokens
  and the call were a third of plain decoding's time here). The result (its acceptance) is the
  whole call's: acceptance drifts over a decode (greedy rows of the byte model at batch 8 passed
  1.3 drafts a cycle in the first 12 cycles and 0.1 after: the batch's a was 1.09, and 12 cycles
  predicted 1.30)."""
  runs, width = [], max(len(p) for p in prompts)
  for tree, k in windows:
    dec = Decoder(params, args, k=k, batch=len(prompts), prompt_len=width,
                  max_new_tokens=max_new_tokens, sampling=sampling, tree=tree)
    runs.append((lambda c, dec=dec: dec(prompts, eos_id=eos_id, pad_id=pad_id, max_cycles=c,
                                        **sample_kw),
                 costmodel.probe_lengths(k if tree is None else tree.k, max_new_tokens)))
  for call, lengths in runs:  # a fresh executable's first call: up to 5x a later one here
    call(lengths[0])
  timed = [[tuple(call(c) for c in lengths) for call, lengths in runs] for _ in range(rounds)]
  return [(timed[0][i][1], *costmodel.cycle_and_fixed(
      [(s.seconds, s.forwards, f.seconds, f.forwards) for s, f in (r[i] for r in timed)]))
          for i in range(len(windows))]


def to_entry(result, cycle: float, fixed: float) -> dict:
  """A probe as the disk cache keeps it (JSON)."""
  return {"rows_hist": np.asarray(result.rows_hist).tolist(), "forwards": result.forwards,
          "tokens_per_forward": result.tokens_per_forward, "cycle_seconds": cycle,
          "fixed_seconds": fixed}


def from_entry(hit):
  """(Probe, seconds per cycle, fixed part) of a disk cache entry; None where there is none or it
  does not read as one (a warning, and the probe runs again)."""
  try:
    if hit is not None:
      return (Probe(np.asarray(hit["rows_hist"], np.int64), int(hit["forwards"]),
                    float(hit["tokens_per_forward"])), float(hit["cycle_seconds"]),
              float(hit["fixed_seconds"]))
  except (KeyError, TypeError, ValueError) as e:
    log.warning("timing cache: ignoring a probe entry (%s: %s); probing again",
                type(e).__name__, e)
  return None
