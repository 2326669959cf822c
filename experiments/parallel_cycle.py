"""The parallel heads' decoding cycle against the one it replaced, in one process: heads 2..k at
the read slot alone (`ParallelHeads.decode_layout`, `heads.Drafting.slot_B`) against every head
block over every window token (`EveryTokenHeads`, the reference the tests compare with).

    python experiments/parallel_cycle.py [--workdir /work/runs50/demo] [--batch 1]
        [--prompt_len 64] [--k 4] [--rounds 9] [--json out.json]

Per program: the compiled chain:k greedy loop (`decode.Decoder`), called with max_cycles 4 and
36 on random prompts, EOS ignored; the cycle's time is the difference / 32 (prefill and call
overhead cancel). Rounds interleave the programs (rotated order); the record gives each
program's median cycle, the median of same-round ratios new / old and its quartiles (the noise
band), whether both gave the same tokens, and XLA's FLOP count of one k-token cached forward of
each (`forward_flops`, exact). Random params unless --workdir (for the timing a
trained model is not needed: the cycle count is fixed by max_cycles).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import contextlib
import dataclasses
import time

import jax
import numpy as np

from mtp_jax import heads
from mtp_jax.heads.parallel import ParallelHeads

REFERENCE = "parallel_every_token"
CYCLES = (4, 36)


class EveryTokenHeads(ParallelHeads):
  """Parallel heads decoded as before the slot cycle: no slot read, so every head block runs
  over every window token (the same params, in the decoding layout)."""
  read_at_slot = False


@contextlib.contextmanager
def every_token(args):
  """args of the same model decoded by `EveryTokenHeads` (registered while inside)."""
  heads.register(REFERENCE)(EveryTokenHeads)
  try:
    yield dataclasses.replace(args, head_kind=REFERENCE)
  finally:
    heads.unregister(REFERENCE)


def cycle_seconds(dec, prompts, pad_id: int) -> float:
  t = []
  for n in CYCLES:
    t0 = time.perf_counter()
    dec(prompts, eos_id=-1, pad_id=pad_id, max_cycles=n)
    t.append(time.perf_counter() - t0)
  return (t[1] - t[0]) / (CYCLES[1] - CYCLES[0])


def forward_flops(params, args, k: int, batch: int, context: int) -> float:
  """XLA's FLOP count of one cached k-token forward (`costmodel.forward_program`: the loop body,
  counted once), heads 2..k as `args`' kind reads them: exact, where the clock is noisy."""
  from mtp_jax.decoding import costmodel
  f, p, cache = costmodel.forward_program(params, args, costmodel.chain(k), batch, context)
  return float(f.lower(p, cache, 1).compile().cost_analysis()["flops"])


def main(argv=None):
  from experiments import common
  from mtp_jax.config import validation
  from mtp_jax.decoding import decode as decode_lib
  from mtp_jax.model import build_model, init_params
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", default="")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--prompt_len", type=int, default=64)
  p.add_argument("--k", type=int, default=4)
  p.add_argument("--rounds", type=int, default=9)
  p.add_argument("--json", default=None)
  a = p.parse_args(argv)
  if a.workdir:
    loaded = common.loaded_workdir(p, a.workdir)
    params, args, pad = loaded.params, loaded.model.args, loaded.tokenizer.pad_id
  else:
    import configs.default as default
    model = build_model(validation.resolve(default.get_config()))
    params, args, pad = init_params(model, jax.random.PRNGKey(0)), model.args, 0
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, min(args.vocab_size, 256), size=a.prompt_len).tolist()
             for _ in range(a.batch)]
  kw = dict(k=a.k, batch=a.batch, prompt_len=a.prompt_len, max_new_tokens=4 * CYCLES[1] + 8)
  decs = {"slot": decode_lib.Decoder(params, args, **kw)}
  with every_token(args) as ref_args:
    decs["every_token"] = decode_lib.Decoder(params, ref_args, **kw)
    toks = {n: d(prompts, eos_id=-1, pad_id=pad).tokens for n, d in decs.items()}  # warm-up
    flops = {n: forward_flops(params, x, a.k, a.batch, a.prompt_len)
             for n, x in (("slot", args), ("every_token", ref_args))}
    names = list(decs)
    sec = {n: [] for n in names}
    for r in range(a.rounds):
      for n in common.rotated(names, r):
        sec[n].append(cycle_seconds(decs[n], prompts, pad))
  speed, band = common.same_round(sec["every_token"], sec["slot"])  # old / new
  rec = {"batch": a.batch, "prompt_len": a.prompt_len, "k": a.k, "rounds": a.rounds,
         "workdir": a.workdir or None,
         "ms_per_cycle": {n: round(1e3 * float(np.median(s)), 3) for n, s in sec.items()},
         # new cycle / old cycle, same round: median and quartiles (the noise band)
         "cycle_ratio_median": round(1 / speed, 3),
         "cycle_ratio_quartiles": sorted(round(1 / x, 3) for x in band),
         "tokens_equal": bool(np.array_equal(toks["slot"], toks["every_token"])),
         # the k-token forward's FLOPs (XLA's count), new / old: what the cycle saves in work
         "forward_flops": flops,
         "forward_flops_ratio": round(flops["slot"] / flops["every_token"], 3)}
  common.emit(rec, a.json)


if __name__ == "__main__":
  main()
