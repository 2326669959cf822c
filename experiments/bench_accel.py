"""One accelerator, one model size: train throughput and MFU of n_future 1 against 4 (parallel
heads, matched parameters), compiled peak memory, and self-speculative decode T1, Tc, a, S.

    python experiments/bench_accel.py --size 350m --dtype bfloat16 --batch auto \\
        --json experiments/results/bench_accel_h200_350m.json

Sizes are GPT-3's shapes (Brown et al. 2020, Table 2.1) built from Llama blocks (RMSNorm, RoPE,
SwiGLU with d_ff ~ 8/3 d rounded up to 256, tied embeddings), vocabulary 32768 (the tokens are
random: the vocabulary only sets the unembedding's cost). n_layers counts the parallel
head blocks (Gloeckle et al. 2024 §3: n=4 takes the last 4 of them as heads), so both variants
have the same parameters. `--size tiny` runs in seconds on a CPU (the smoke test).

Train: each variant's step (model, per-head loss, gradients, AdamW) is compiled once, run
`--warmup` steps, then timed for `--steps`; the median step gives tokens/s (batch * seq_len
input positions) and MFU = tokens/s * train FLOPs per token / (peak FLOP/s * devices), FLOPs
from mtp_jax.flops, the peak from its datasheet table (or a measured matmul peak on a CPU).
`--batch auto` doubles or halves the size's default batch until the n=4 step's compiled peak
memory fills at most `--fill` of the device, then uses that batch for both variants.

Decode (mtp_jax.decoding.decode; the cost model S = a T1/Tk of BACKGROUND.md §5): greedy (k=1) and
speculative (k=4) on the n=4 model for batch 1 and 8, EOS ignored so the work is fixed; T1 =
greedy seconds per forward, Tc = speculative seconds per cycle (both inside the loops), a =
tokens per cycle, S_measured = greedy / speculative wall time, S_predicted = a_batch * T1_fwd /
Tk_fwd from a one-token and a k-token forward timed on their own (decode.forward_seconds; the
in-loop a * T1 / Tc would equal S_measured by construction). With the random-init params a is
meaningless (only the times are); `--workdir DIR` decodes a trained
model instead, on held-out windows of its validation split.

`--target tpu:TOPOLOGY` (libtpu: make .venv-tpu) runs nothing: experiments/aot_decode.py compiles
the decode cost model's T1 and Tk forwards for `--sizes` with XLA:TPU and reports the compiler's
estimates and the S they predict with acceptances measured on a CPU-trained model.
`--target gpu:h100|h200` (.venv-gpu) compiles the same forwards with XLA:GPU: their memory per
GPU, and no T1, Tk or S (XLA:GPU's cost_analysis() gives nothing).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import os
import sys
import time

import jax
import numpy as np

from experiments import common
from mtp_jax import config as config_lib
from mtp_jax.config import validation
from mtp_jax.decoding import decode as decode_lib
from mtp_jax import flops as flops_lib
from mtp_jax.backends.cpu import runtime
from mtp_jax import sharding as shard_lib
from mtp_jax.model import param_count

from mtp_jax import steps as steps_lib

# d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab, seq_len, default batch, remat policy
SIZES = {
    "tiny": (64, 6, 4, 2, 128, 256, 32, 2, "none"),
    "default": (256, 6, 8, 4, 768, 259, 256, 16, "none"),  # configs/default.py: the demo's model
    "125m": (768, 12, 12, 12, 2048, 32768, 2048, 32, "dots_with_no_batch_dims_saveable"),
    "350m": (1024, 24, 16, 16, 2816, 32768, 2048, 16, "dots_with_no_batch_dims_saveable"),
    "1.3b": (2048, 24, 16, 16, 5632, 32768, 2048, 8, "dots_with_no_batch_dims_saveable"),
}
K = 4  # the MTP variant's n_future and the speculative decode's heads
DECODE_BATCHES = (1, 8)
RANDOM_NOTE = ("random-init params: a (and so S_predicted) says nothing about a trained model; "
               "the times are real. Pass --workdir for a trained model's a.")


def make_config(size: str, n_future: int, dtype: str, batch: int, overrides):
  d, layers, heads, kv, ff, vocab, seq, _, remat = SIZES[size]
  c = config_lib.base_config()
  m = c.model
  m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff = d, layers, heads, kv, ff
  m.vocab_size, m.max_len, m.n_future, m.dtype, m.remat_policy = vocab, seq, n_future, dtype, remat
  m.heads.kind = "parallel"
  c.data.seq_len, c.train.batch_size = seq, batch
  common.apply_overrides(c, overrides)
  return validation.validate(c)


def _training(c):
  """build_training on one device, however many there are."""
  return steps_lib.build_training(c, shard_lib.make_mesh(c, devices=jax.devices()[:1]))


def compiled_peak(c) -> int:
  """Compiled peak bytes of the train step, from shapes alone (nothing allocated)."""
  training = _training(c)
  state = jax.eval_shape(training.init_state)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), common.random_batch(c))
  return common.memory_record(training.step.lower(state, batch).compile())["peak_bytes"]


def fit_batch(make, start: int, limit: float) -> int:
  """The largest power-of-two multiple or fraction of `start` whose step fits in `limit`."""
  b = start
  if compiled_peak(make(b)) > limit:
    while b > 1:
      b //= 2
      if compiled_peak(make(b)) <= limit:
        return b
    raise ValueError(f"--batch: even batch 1 needs more than {limit / 2**30:.1f} GiB")
  while compiled_peak(make(2 * b)) <= limit:
    b *= 2
  return b


def bench_train(c, steps: int, warmup: int, peak: float):
  """(record, final params, model args) of one variant; its optimizer state is freed on
  return."""
  training = _training(c)
  state = training.init_state(0)
  batch = jax.device_put(common.random_batch(c))
  t = time.perf_counter()
  compiled = training.step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t
  for _ in range(warmup):
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t)
  med = float(np.median(times))
  tokens_s = c.train.batch_size * c.data.seq_len / med
  fpt = flops_lib.flops_per_token(c)
  rec = {"n_future": c.model.n_future, "params": param_count(state.params),
         "step_seconds_median": med, "step_seconds": times, "tokens_per_second": tokens_s,
         "mfu": flops_lib.mfu(tokens_s, fpt["total"], peak, 1),
         "train_flops_per_token": fpt, "compile_seconds": compile_s,
         "loss_after": float(m["loss"]), **common.memory_record(compiled)}
  return rec, state.params, training.model.args


def bench_decode(params, args, prompts_for, max_new: int, pad_id: int = 0,
                 reps: int = 3) -> list[dict]:
  """Greedy and speculative decoding of the same prompts; the fastest of `reps` timed calls of
  each (the first call, which compiles, is not timed)."""
  k = min(K, args.n_future)
  out = []
  for batch in DECODE_BATCHES:
    prompts = prompts_for(batch)
    kw = dict(max_new_tokens=max_new, eos_id=-1, pad_id=pad_id)
    fastest = lambda heads, prompts=prompts, kw=kw: min(
        (decode_lib.decode(params, args, prompts, k=heads, **kw) for _ in range(1 + reps)),
        key=lambda r: r.seconds)
    g, s = fastest(1), fastest(k)
    T1, Tc, a = g.seconds / g.forwards, s.seconds / s.forwards, s.tokens_per_forward
    a_batch = g.forwards / s.forwards  # what the slowest row allows the whole batch
    cost = decode_lib.forward_seconds(params, args, k, batch=batch,
                                      context=len(prompts[0]) + max_new // 2)
    out.append({"batch": batch, "k": k, "prompt_len": len(prompts[0]), "max_new_tokens": max_new,
                "T1": T1, "Tc": Tc, "Tc_over_T1": Tc / T1, "a": a, "a_batch": a_batch,
                "forward_1_seconds": cost["forward_1"], "forward_k_seconds": cost["forward_k"],
                "S_predicted": a_batch * cost["forward_1"] / cost["forward_k"],
                "S_measured": g.seconds / s.seconds,
                "identical": bool(np.array_equal(g.tokens, s.tokens))})
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--size", choices=list(SIZES), default="tiny")
  ap.add_argument("--dtype", choices=list(config_lib.DTYPES), default=None,
                  help="compute dtype (params and optimizer state stay float32); default "
                  "float32, bfloat16 (params and cache too) with --target")
  ap.add_argument("--batch", default="default",
                  help="'default' (the size's), 'auto' (fill the device) or a number")
  ap.add_argument("--fill", type=float, default=0.85, help="--batch auto: memory fraction")
  ap.add_argument("--steps", type=int, default=10, help="timed train steps per variant")
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--prompt_len", type=int, default=None, help="default: 128 (tiny: 8)")
  ap.add_argument("--max_new_tokens", type=int, default=None, help="default: 128 (tiny: 16)")
  ap.add_argument("--decode_reps", type=int, default=3, help="timed decode calls (fastest kept)")
  ap.add_argument("--workdir", default=None, help="decode this trained model instead (with "
                  "--target: its shape, with --acceptance measured on it)")
  ap.add_argument("--set", nargs="*", default=[], help="config overrides: model.remat_policy=full")
  ap.add_argument("--json", default=None, help="also write the record here")
  ap.add_argument("--target", default="", help="tpu:TOPOLOGY or gpu:h100|h200: the compiler's "
                  "estimates of the decode cost model instead of measurements "
                  "(experiments/aot_decode.py)")
  ap.add_argument("--sizes", default="125m,350m,1.3b", help="--target: sizes, comma-separated")
  ap.add_argument("--context", type=int, default=192, help="--target: cached tokens")
  ap.add_argument("--acceptance", default=os.path.join(os.path.dirname(
      os.path.abspath(__file__)), "results", "bench_decode.json"),
                  help="--target: bench_decode.py JSON with the measured a per batch")
  ap.add_argument("--acceptance_prompt_len", type=int, default=64)
  args = ap.parse_args(argv)
  if args.target:
    return _aot_main(args)
  args.dtype = args.dtype or "float32"
  if args.batch not in ("default", "auto") and not (args.batch.isdigit() and int(args.batch) > 0):
    raise ValueError(f"--batch: got {args.batch!r}, allowed: 'default', 'auto' or a positive "
                     "integer")
  tiny = args.size == "tiny"
  prompt_len = args.prompt_len or (8 if tiny else 128)
  max_new = args.max_new_tokens or (16 if tiny else 128)
  make = lambda n, b: make_config(args.size, n, args.dtype, b, args.set)
  device = jax.devices()[0]
  peak, peak_source = flops_lib.peak_flops_per_device(args.dtype, device)
  batch = SIZES[args.size][7]
  if args.batch == "auto":
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
      batch = fit_batch(lambda b: make(K, b), batch, args.fill * limit)
  elif args.batch != "default":
    batch = int(args.batch)

  train, params, model_args = [], None, None
  for n in (1, K):
    rec, params, model_args = bench_train(make(n, batch), args.steps, args.warmup, peak)
    train.append(rec)
  c = make(1, batch)
  record = {
      "size": args.size, "device_kind": device.device_kind, "platform": device.platform,
      "n_devices": 1, "dtype": args.dtype, "peak_flops_per_device": peak,
      "peak_source": peak_source,
      "model": {f: c.model[f] for f in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                                         "vocab_size", "remat_policy")},
      "overrides": list(args.set), "batch": batch, "seq_len": c.data.seq_len,
      "steps": args.steps, "train": train,
      "step_ratio_n4_over_n1": train[1]["step_seconds_median"] / train[0]["step_seconds_median"],
  }

  rng = np.random.default_rng(1)
  prompts_for = lambda b: [rng.integers(1, model_args.vocab_size, prompt_len) for _ in range(b)]
  params_from, note, pad_id = "random-init (the n=4 train variant's params)", RANDOM_NOTE, 0
  if args.workdir:
    from mtp_jax.workdir import load_workdir
    from experiments.bench_decode import heldout_prompts
    loaded = load_workdir(args.workdir)
    params, model_args = loaded.params, loaded.model.args
    prompts_for = lambda b: heldout_prompts(loaded, b, prompt_len)
    params_from, note = f"{args.workdir} (step {loaded.step})", "held-out validation windows"
    pad_id = loaded.tokenizer.pad_id
  record["decode"] = {"params_from": params_from, "note": note,
                      "runs": bench_decode(params, model_args, prompts_for, max_new, pad_id,
                                           args.decode_reps)}
  common.emit(record, args.json)
  return record


def workdir_config(workdir: str, n_future: int, dtype: str, overrides):
  """`--target` with `--workdir`: the workdir's model shape (its head kind, its n_future at
  least `n_future`) in `dtype`, for aot_decode's estimate."""
  from mtp_jax.workdir import config_path, read_config
  if not os.path.isfile(config_path(workdir)):
    raise ValueError(f"--workdir: {workdir} is not a workdir (no config.json)")
  c = read_config(workdir)
  if c.model.n_future < n_future:
    raise ValueError(f"--workdir: {n_future} heads needed, {workdir} has n_future "
                     f"{c.model.n_future}")
  c.model.dtype = dtype
  common.apply_overrides(c, overrides)
  return validation.validate(c)


def _aot_main(args) -> dict:
  from experiments import aot_decode
  dtype = args.dtype or "bfloat16"
  if args.workdir:  # the workdir's shape, under its own name
    sizes = [os.path.basename(os.path.normpath(args.workdir))]
    make = lambda size, n, dt, b: workdir_config(args.workdir, n, dt, args.set)
  else:
    sizes = [x for x in args.sizes.split(",") if x]
    bad = [x for x in sizes if x not in SIZES]
    if bad or not sizes:
      raise ValueError(f"--sizes: got {args.sizes!r}, allowed: {', '.join(SIZES)}")
    make = lambda size, n, dt, b: make_config(size, n, dt, b, args.set)
  record = aot_decode.estimate(args.target, sizes, make, K, dtype, args.context,
                               args.acceptance, args.acceptance_prompt_len)
  if args.workdir:
    record["workdir"] = os.path.abspath(args.workdir)
  common.emit(record, args.json)
  return record


if __name__ == "__main__":
  try:
    main()
  except ValueError as e:  # bad flags and config overrides: one line, not a traceback
    sys.exit(f"error: {e}")
