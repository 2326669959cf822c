"""A decoding cycle's time under two checkouts of this code, in one run: a change to the decoder
judged against the code it replaces (the two-phase forward was, docs/decoding.md).

    python experiments/cycle_ab.py --ref_tree DIR [--workdir W] [--kinds K1,K2] \\
        [--modes greedy,sampled] [--batches 1,8] [--k 4] [--prompt_len 64] [--rounds 7] \\
        [--cycles 4,36] [--json out.json]

Each checkout is a worker process running this file with its own `mtp_jax` first on PYTHONPATH
(the worker imports mtp_jax and configs/ alone, so any checkout that has them serves). Per cell
(head kind x mode x batch) it compiles the chain:k loop (`decode.Decoder`) on the same params
(the workdir's, or configs/default.py's initialised from key 0 for each kind of --kinds), warms
it up, and per request times the cycle: a call with max_cycles 4 and one with 36 (--cycles) on
random prompts of --prompt_len ids, EOS ignored, (t36 - t4) / 32, so prefill and call overhead
cancel (experiments/parallel_cycle.py's measure). Sampled cells draw at temperature 1, top-p 0.95.
Rounds alternate the two workers (one waits while the other runs; rotated order). Per cell the
record gives each side's median ms per cycle, this code's cycle over the reference's (median of
same-round ratios, quartiles, the 95% paired bootstrap interval, Wilcoxon's signed-rank p for
"no change", and the rounds' seconds) and whether both decoded the same tokens.
--smoke: a tiny model, greedy, batch 1, 2 rounds (the suite's run; --ref_tree defaults to this
checkout there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "seed": 1}


def worker_cells(a):
  """[(name, run() -> (seconds per cycle, sha256 of the tokens))], each warmed up."""
  import jax
  import numpy as np

  from mtp_jax.decoding import decode as decode_lib
  from mtp_jax.model import build_model, init_params
  models = []
  if a.workdir:
    from mtp_jax.workdir import load_workdir
    w = load_workdir(a.workdir)
    models.append((w.model.args.head_kind, w.params, w.model.args, w.tokenizer.pad_id))
  else:
    import configs.default as default
    from mtp_jax.config import validation
    for kind in a.kinds.split(","):
      c = default.get_config()
      c.model.heads.kind = kind
      if a.smoke:
        c.model.update(d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=64, max_len=256)
      model = build_model(validation.resolve(c))
      models.append((kind, init_params(model, jax.random.PRNGKey(0)), model.args, 0))
  cells, cycles = [], [int(x) for x in a.cycles.split(",")]
  for kind, params, args, pad in models:
    for batch in map(int, a.batches.split(",")):
      rng = np.random.default_rng(batch)
      prompts = [rng.integers(3, min(args.vocab_size, 256), size=a.prompt_len).tolist()
                 for _ in range(batch)]
      for mode in a.modes.split(","):
        sampled = mode == "sampled"
        dec = decode_lib.Decoder(params, args, k=a.k, batch=batch, prompt_len=a.prompt_len,
                                 max_new_tokens=a.k * cycles[1] + 8, sampling=sampled)
        kw = dict(eos_id=-1, pad_id=pad, **(SAMPLING if sampled else {}))

        def run(dec=dec, prompts=prompts, kw=kw):
          t, toks = [], None
          for n in cycles:
            t0 = time.perf_counter()
            toks = dec(prompts, max_cycles=n, **kw).tokens
            t.append(time.perf_counter() - t0)
          sha = hashlib.sha256(np.asarray(toks, np.int32).tobytes()).hexdigest()[:16]
          return (t[1] - t[0]) / (cycles[1] - cycles[0]), sha
        run()  # warm-up: compile, caches, allocator
        cells.append((f"{kind}/{mode}/b{batch}", run))
  return cells


def worker(a):
  if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
    from mtp_jax.backends.cpu import runtime
    runtime.apply_cpu_defaults()
  cells = worker_cells(a)
  import mtp_jax
  print(json.dumps({"ready": os.path.dirname(os.path.dirname(mtp_jax.__file__))}), flush=True)
  for line in sys.stdin:
    if line.strip() != "run":
      break
    out = {}
    for name, run in cells:
      s, sha = run()
      out[name] = {"seconds": s, "tokens_sha256": sha}
    print(json.dumps(out), flush=True)


def start_worker(tree: str, argv: list[str]):
  """This file as a worker process, `tree`'s mtp_jax first on PYTHONPATH."""
  from experiments import common
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree)] + [
      p for p in [env.get("PYTHONPATH")] if p])
  return common.Worker([sys.executable, os.path.abspath(__file__), "--worker", *argv], env,
                       os.path.abspath(tree), f"{tree}'s")


def wilcoxon_p(ref: list[float], new: list[float]) -> float | None:
  """Two-sided Wilcoxon signed-rank p-value of the rounds' log(ref / new) (None under 2 rounds;
  with 7 rounds the smallest possible is 0.016)."""
  if len(ref) < 2:
    return None
  from scipy import stats
  d = np.log(np.asarray(ref, float) / np.asarray(new, float))
  return None if not d.any() else round(float(stats.wilcoxon(d).pvalue), 4)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--ref_tree", default=None, help="the reference checkout")
  ap.add_argument("--workdir", default="")
  ap.add_argument("--kinds", default="parallel,projection,sequential")
  ap.add_argument("--modes", default="greedy,sampled")
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--cycles", default="4,36", help="max_cycles of the two timed calls")
  ap.add_argument("--json", default=None)
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.smoke:
    a.kinds, a.modes, a.batches, a.k, a.prompt_len, a.rounds = "parallel", "greedy", "1", 2, 8, 2
    a.ref_tree = a.ref_tree or ROOT
  if a.worker:
    return worker(a)
  if not a.ref_tree:
    ap.error("--ref_tree: required (a checkout of this repository to compare with)")
  if not os.path.isdir(os.path.join(a.ref_tree, "mtp_jax")):
    ap.error(f"--ref_tree: {a.ref_tree!r} holds no mtp_jax package")
  if a.workdir and not os.path.isdir(a.workdir):
    ap.error(f"--workdir: no such directory: {a.workdir}")
  from experiments import common
  from mtp_jax.decoding import speed as speed_lib
  cycles = a.cycles.split(",")
  if len(cycles) != 2 or not all(c.isdigit() for c in cycles) or int(cycles[0]) >= int(cycles[1]):
    ap.error(f"--cycles: two counts, the first smaller (e.g. 4,36), got {a.cycles!r}")
  wargv = ["--kinds", a.kinds, "--modes", a.modes, "--batches", a.batches, "--k", str(a.k),
           "--prompt_len", str(a.prompt_len), "--cycles", a.cycles]
  wargv += (["--smoke"] if a.smoke else []) + (
      ["--workdir", os.path.abspath(a.workdir)] if a.workdir else [])
  sides = {"ref": start_worker(a.ref_tree, wargv), "new": start_worker(ROOT, wargv)}
  rounds = {n: [] for n in sides}
  t0 = time.time()
  for r in range(a.rounds):
    for n in common.rotated(list(sides), r):
      rounds[n].append(sides[n].call("run"))
    print(f"round {r + 1}/{a.rounds} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
  for w in sides.values():
    w.close()
  cells = {}
  for name in rounds["new"][0]:
    s = {n: [x[name]["seconds"] for x in rs] for n, rs in rounds.items()}
    speed, band = common.same_round(s["ref"], s["new"])  # ref / new
    cells[name] = {
        "ms_per_cycle": {n: round(1e3 * sorted(v)[len(v) // 2], 3) for n, v in s.items()},
        "cycle_new_over_ref": round(1 / speed, 3),
        "cycle_new_over_ref_quartiles": sorted(round(1 / x, 3) for x in band),
        # the 95% paired bootstrap interval of the median same-round ratio, and Wilcoxon's
        # signed-rank p-value for "no change" (two-sided, on the rounds' log ratios)
        "cycle_new_over_ref_ci": sorted(round(1 / x, 3)
                                        for x in speed_lib.paired_ci(s["ref"], s["new"])),
        "p_value": wilcoxon_p(s["ref"], s["new"]),
        "seconds": {n: [round(x, 6) for x in v] for n, v in s.items()},
        "same_tokens": rounds["new"][-1][name]["tokens_sha256"]
        == rounds["ref"][-1][name]["tokens_sha256"]}
  rec = {"ref_tree": sides["ref"].ready["ready"], "new_tree": sides["new"].ready["ready"],
         "workdir": a.workdir or None, "k": a.k, "prompt_len": a.prompt_len,
         "rounds": a.rounds, "cycles": a.cycles, "sampling": SAMPLING, "cells": cells}
  common.emit(rec, a.json)


if __name__ == "__main__":
  main()
