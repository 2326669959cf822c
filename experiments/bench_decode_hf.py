"""Our greedy and speculative decoding against Hugging Face `generate` on the same model.

    python experiments/bench_decode_hf.py --workdir DIR --json out/bench_decode_hf.json \\
        [--batches 1,8] [--prompt_len 32] [--max_new 128] [--reps 5] [--variants "chain:4 auto"]

The workdir's trunk and head 1 are exported with `convert to-hf` (a temporary folder) and loaded
by transformers (AutoModelForCausalLM, float32, PyTorch's default threads); both sides decode
the same held-out prompts (windows of validation code, all of --prompt_len tokens, so HF needs
no padding) to exactly --max_new tokens (EOS ignored: fixed work). HF runs `generate(do_sample=
False, use_cache=True)`, its default dynamic KV cache. Every side is its own worker process (as
a user runs either one; PyTorch's OpenMP threads spin after a call and would slow a JAX call
that follows in the same process), built and warmed up once, then asked for one call each,
round after round (each round starting one side later), so machine noise hits all alike.
Records per batch size: tokens/s of each side (median over rounds), the ratio to HF (median of
same-round ratios too) and whether the tokens agree: HF's greedy tokens against ours, row by
row (a float32 near-tie can flip one argmax; the first differing position is recorded), our
speculative tokens against our greedy (exact by construction). Each record names the machine
(CPU model, ISA flags).
`--ref_tree DIR` adds plain greedy decoding by another checkout's code as side plain@ref (its
tokens checked against ours) and records this code's speed over it, the median same-round
ratio and its quartiles: a code change judged in one run.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from experiments import common


def heldout(workdir, batch, length, seed):
  """`batch` held-out prompts of `length` tokens (bench_decode's windows of validation code),
  read with the workdir's config and tokenizer alone (no params, no JAX)."""
  import types

  from experiments.bench_decode import heldout_prompts
  from mtp_jax.config import validation
  from mtp_jax import workdir as workdir_lib
  from mtp_jax.data import tokenizers
  config = validation.resolve(workdir_lib.read_config(workdir))
  loaded = types.SimpleNamespace(config=config, tokenizer=tokenizers.get_tokenizer(config.data))
  return [p.tolist() for p in heldout_prompts(loaded, batch, length, seed=seed)]


def jax_side(args, variant):
  """(run(prompts) -> tokens [B, max_new], info) for our decoder `variant` (plain or chain:K /
  auto), compiled for len(prompts) rows."""
  from mtp_jax.decoding import decode as decode_lib
  from mtp_jax.workdir import load_workdir
  loaded = load_workdir(args.workdir)
  a = loaded.model.args
  ids = dict(eos_id=-1, pad_id=loaded.tokenizer.pad_id)
  state = {}

  def run(prompts):
    if "dec" not in state:  # built on the first call: the batch is known then
      k = 1
      if variant != "plain":
        want = variant.split(":", 1)[1] if ":" in variant else "auto"
        want = a.n_future if want == "all" else (want if want == "auto" else int(want))
        k, _, _ = decode_lib.resolve(loaded.params, a, prompts, max_new_tokens=args.max_new,
                                     k=want, tree=None, **ids)
      state["dec"] = decode_lib.Decoder(loaded.params, a, k=k, batch=len(prompts),
                                        prompt_len=args.prompt_len,
                                        max_new_tokens=args.max_new)
    r = state["dec"](prompts, **ids)
    state["heads"], state["forwards"] = r.heads, r.forwards
    return np.asarray(r.tokens)[:, :args.max_new]
  return run, state


def hf_model(workdir: str):
  """(transformers' model of the workdir's trunk and head 1, exported with `convert to-hf`
  into a folder gone once loaded, in float32; info naming torch, transformers and the class)."""
  import torch
  import transformers

  from mtp_jax.convert.workdir import export_hf
  with tempfile.TemporaryDirectory(prefix="bench_decode_hf_") as out:
    export_hf(workdir, out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  info = {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
          "torch_threads": torch.get_num_threads(), "hf_architecture": type(model).__name__}
  return model, info


def hf_side(args):
  """(run(prompts) -> tokens [B, max_new], info) for transformers' generate on the exported
  model."""
  import torch
  model, info = hf_model(args.workdir)
  model.generation_config.eos_token_id = None  # fixed work: never stop early

  def run(prompts):
    with torch.inference_mode():
      x = torch.tensor(prompts, dtype=torch.long)
      y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=args.max_new, min_new_tokens=args.max_new,
                         pad_token_id=0, use_cache=True)
    return y[:, x.shape[1]:].numpy()
  return run, info


def worker(args):
  """One side in its own process: one JSON line (seconds, tokens) per `run PROMPTS` line on
  stdin (PROMPTS: a JSON list of token-id lists)."""
  side = args.worker
  run, info = hf_side(args) if side == "hf" else jax_side(args, side)
  print(json.dumps({"ready": True}), flush=True)
  for line in sys.stdin:
    if not line.startswith("run "):
      break
    prompts = json.loads(line[4:])
    t = time.perf_counter()
    toks = run(prompts)
    seconds = time.perf_counter() - t
    extra = dict(info) if side == "hf" else {"heads": info.get("heads"),
                                              "forwards": info.get("forwards")}
    print(json.dumps({"seconds": seconds, "tokens": np.asarray(toks).tolist(), **extra}),
          flush=True)


REF = "plain@ref"  # the side of --ref_tree


def start_worker(args, side) -> common.Worker:
  """`side`'s worker process (REF: plain decoding by the other checkout's code)."""
  cwd = None
  if side == REF:
    side, cwd = "plain", args.ref_tree
  cmd, env = common.module_command("bench_decode_hf", tree=cwd)
  cmd += ["--worker", side, "--workdir", os.path.abspath(args.workdir), "--prompt_len",
          str(args.prompt_len), "--max_new", str(args.max_new), "--seed", str(args.seed)]
  return common.Worker(cmd, env, cwd, side)


def first_difference(a_BxT, b_BxT):
  """Per row: the first position where the two differ, or None."""
  out = []
  for x, y in zip(np.asarray(a_BxT), np.asarray(b_BxT)):
    d = np.flatnonzero(x != y)
    out.append(int(d[0]) if d.size else None)
  return out


def bench_batch(workers, prompts, args):
  batch = len(prompts)
  for w in workers.values():  # warm-up: compiles, caches, allocator
    w.call(f"run {json.dumps(prompts)}")
  rounds = {name: [] for name in workers}
  for i in range(args.reps):  # each round starts one side later: no side always follows another
    for name in common.rotated(list(workers), i):
      time.sleep(args.settle)  # let the previous side's threads go idle
      rounds[name].append(workers[name].call(f"run {json.dumps(prompts)}"))
  tokens = batch * args.max_new
  rec = {"batch": batch, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new,
         "reps": args.reps, "sides": {}}
  hf_s = np.array([r["seconds"] for r in rounds["hf"]])
  greedy_toks = rounds["plain"][-1]["tokens"]
  for name, rs in rounds.items():
    s = np.array([r["seconds"] for r in rs])
    side = {"seconds": s.tolist(), "seconds_median": float(np.median(s)),
            "tokens_per_sec": tokens / float(np.median(s))}
    if name != "hf":
      side.update(ratio_to_hf=float(np.median(hf_s) / np.median(s)),
                  ratio_to_hf_same_round=float(np.median(hf_s / s)),
                  heads=rs[-1].get("heads"), forwards=rs[-1].get("forwards"),
                  identical_to_greedy=bool(np.array_equal(rs[-1]["tokens"], greedy_toks)))
    else:
      side.update({k: v for k, v in rs[-1].items() if k not in ("seconds", "tokens")})
    rec["sides"][name] = side
  if REF in rounds:  # this code's plain decoding over the other checkout's, round by round
    rec["plain_over_ref_same_round"], rec["plain_over_ref_quartiles"] = common.same_round(
        [r["seconds"] for r in rounds[REF]], [r["seconds"] for r in rounds["plain"]])
    rec["ref_tree"] = os.path.abspath(args.ref_tree)
  diff = first_difference(greedy_toks, rounds["hf"][-1]["tokens"])
  rec["hf_tokens_agree"] = all(d is None for d in diff)
  rec["hf_first_difference_per_row"] = diff
  return rec


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--json", default=None)
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--max_new", type=int, default=128)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--variants", default="chain:4 auto",
                  help="our speculative variants besides plain greedy: chain:K, chain:all, auto")
  ap.add_argument("--settle", type=float, default=0.3,
                  help="seconds between calls of different sides")
  ap.add_argument("--ref_tree", default=None,
                  help="another checkout of this repository (e.g. `git worktree add /tmp/ref "
                       "HEAD~1`): its plain greedy decoding runs as one more side, plain@ref, "
                       "so a code change is judged against the code before it in one run")
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    return worker(args)
  if args.ref_tree and not common.is_checkout(args.ref_tree, "bench_decode_hf"):
    ap.error(f"--ref_tree: {args.ref_tree!r} is not a checkout of this repository "
             "(no experiments/bench_decode_hf.py in it)")
  sides = ["hf", "plain", *args.variants.split(), *([REF] if args.ref_tree else [])]
  for v in args.variants.split():
    if not (v == "auto" or (v.startswith("chain:") and (v[6:] == "all" or v[6:].isdigit()))):
      ap.error(f"--variants: {v!r} is not chain:K, chain:all or auto")
  batches = common.positive_ints(ap, "--batches", args.batches)
  records = []
  for b in batches:  # fresh workers per batch: each compiles for its batch
    workers = {s: start_worker(args, s) for s in sides}
    try:
      rec = bench_batch(workers, heldout(args.workdir, b, args.prompt_len, args.seed), args)
    finally:
      for w in workers.values():
        w.close()
    rec.update(workdir=args.workdir, load_avg_1min=os.getloadavg()[0],
               xla_flags=os.environ.get("XLA_FLAGS", ""),
               glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""))
    records.append(rec)
    print(json.dumps({k: rec[k] for k in ("batch", "hf_tokens_agree")} | {
        n: round(s["tokens_per_sec"]) for n, s in rec["sides"].items()} | {
        f"{n}/hf": round(s["ratio_to_hf"], 3) for n, s in rec["sides"].items() if n != "hf"} | (
        {"plain/ref": round(rec["plain_over_ref_same_round"], 3)} if args.ref_tree else {})),
        flush=True)
  common.write_json(records, args.json, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
