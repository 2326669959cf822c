"""The self-speculative decode cost model on a TPU or GPU that is not here: XLA:TPU's estimates
of T1 and Tk (on a GPU, whose cost_analysis() gives nothing, a model of ours from what XLA:GPU
compiled), and the speed-up S they predict with acceptances measured on CPU-trained models.

    python experiments/bench_accel.py --target tpu:v5e:2x2 [--sizes 125m,350m,1.3b] \\
        [--acceptance experiments/results/bench_decode.json] --json OUT.json

On a GPU target T1 and Tk come from a model of ours instead (`aot.gpu_step_seconds`): the
kernels each forward launches, as XLA:GPU compiled it with every scan unrolled, at
aot.GPU_LAUNCH_SECONDS each, plus its argument bytes (params, cache) at the memory bandwidth; the
record also gives S from the bandwidth alone.

(bench_accel.py hands `--target` here.) For each size (bench_accel.SIZES: GPT-3 shapes from
Llama blocks, 4 parallel heads) and batch 1 and 8, on one chip of the target: the same two
cached forwards as decode.forward_seconds (the hidden states of one token through head 1 alone,
T1, and of k tokens through heads 1..k, Tk; the unembedding aside, as there), compiled by
XLA:TPU from shapes alone with every scan unrolled, and their `optimal_seconds` from
cost_analysis: the compiler's roofline estimate, NOT a measured time. Params and cache in
`--dtype` (bfloat16: what a TPU would serve). Then S_predicted = a_batch x T1 / Tk, with a_batch
(tokens per cycle of the slowest row) measured on a CPU-trained 4-head model by
bench_decode.py (`--acceptance`, its batch-1 and batch-8 records at `--acceptance_prompt_len`);
those a come from a small byte-level model, not from these shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from mtp_jax import aot
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.model import MTPModel, build_model, init_decode_cache

BATCHES = (1, 8)


def acceptances(path: str, k: int, prompt_len: int) -> dict[int, dict]:
  """{batch: record} of bench_decode.py's greedy records with k heads at prompt_len."""
  with open(path) as f:
    records = json.load(f)
  out = {r["batch"]: r for r in records
         if r.get("heads") == k and r.get("prompt_len") == prompt_len
         and r.get("mode") in (None, "greedy")}
  missing = [b for b in BATCHES if b not in out]
  if missing:
    raise ValueError(f"--acceptance: {path} has no greedy record with {k} heads at prompt_len "
                     f"{prompt_len} for batch {missing}")
  return out


def forward_cost(model_args, k: int, batch: int, context: int, dtype, device) -> dict:
  """decode.forward_seconds' forward (heads 1..k, a k-token window at `context` tokens of cache)
  compiled for `device` from shapes alone; the compiler's cost record."""
  params = jax.eval_shape(lambda: nn.unbox(MTPModel(model_args).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]))
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), params)
  p = jax.eval_shape(lambda q: decode_lib.slice_heads(q, model_args, k)[0], params)
  a = dataclasses.replace(model_args, n_future=k)  # as slice_heads' args
  model = MTPModel(a)
  cache = jax.eval_shape(lambda: init_decode_cache(a, batch, context + k + 1, dtype=dtype))
  mesh = jax.sharding.Mesh(np.asarray([device]), ("data",))
  on = lambda tree: jax.tree.map(lambda s: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())),
                                 tree)
  toks = jnp.zeros((batch, k), jnp.int32)
  pos = context + jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))
  # The cache donated, as in a decoding loop, where it is updated in place: otherwise the
  # estimate includes copying the whole cache into a new output buffer.
  f = jax.jit(lambda p, c, t, q: model.apply({"params": p}, t, positions_BxS=q, cache=c,
                                             decoding=True), donate_argnums=1)
  i32 = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  timed = device.platform == "tpu"
  # Every scan unrolled: XLA:TPU's cost counts a loop body once; on a GPU, the kernels counted
  # must be those of one call.
  with jax.set_mesh(mesh), aot.unrolled_scans():
    compiled = f.lower(on(p), on(cache), i32(toks), i32(pos)).compile(
        aot.cost_compiler_options(device))
  rec = aot.cost_record(compiled, device, jnp.dtype(dtype).name, None)
  if device.platform == "gpu":  # gpu_step_seconds' inputs
    rec["kernels"] = aot.gpu_kernels(compiled)
    rec["argument_bytes"] = common.memory_record(compiled)["argument_bytes"]
  if timed and rec["optimal_seconds"] is None:
    raise ValueError(f"--target: XLA:TPU gave no time for the {k}-token forward "
                     f"(optimal_seconds {rec.get('optimal_seconds_invalid')})")
  rec["while_loops"] = aot.while_loops(compiled)
  rec["peak_bytes"] = common.memory_record(compiled)["peak_bytes"]
  return rec


def estimate(target_text: str, sizes: list[str], make_config, k: int, dtype: str,
             context: int, acceptance_path: str, acceptance_prompt_len: int) -> dict:
  target = aot.parse_target(target_text)
  if target[0] == "cpu":
    raise ValueError(f"--target: the compiler estimates need a TPU or GPU target, got "
                     f"{target_text!r}")
  accepted = acceptances(acceptance_path, k, acceptance_prompt_len)
  aot.prepare_env(target)
  device = aot.target_devices(target)[0]
  runs = []
  for size in sizes:
    args = build_model(make_config(size, k, dtype, 1)).args
    for batch in BATCHES:
      t0 = time.perf_counter()
      one = forward_cost(args, 1, batch, context, jnp.dtype(dtype), device)
      many = forward_cost(args, k, batch, context, jnp.dtype(dtype), device)
      a = accepted[batch]
      T1, Tk = one["optimal_seconds"], many["optimal_seconds"]
      gpu = {}
      if device.platform == "gpu":  # our model of the two programs, from what XLA:GPU compiled
        T1, Tk = (aot.gpu_step_seconds(r["kernels"], r["argument_bytes"], device.device_kind)
                  for r in (one, many))
        bw1, bwk = (aot.gpu_step_seconds(0, r["argument_bytes"], device.device_kind)
                    for r in (one, many))
        gpu = {"kernels_1": one["kernels"], "kernels_k": many["kernels"],
               "argument_bytes_1": one["argument_bytes"],
               "argument_bytes_k": many["argument_bytes"],
               "launch_seconds_assumed": aot.GPU_LAUNCH_SECONDS,
               "Tk_over_T1_bandwidth_only": bwk / bw1,
               "S_predicted_bandwidth_only": a["a_batch"] * bw1 / bwk}
      timed = T1 is not None and Tk is not None
      runs.append({
          "size": size, "batch": batch, "k": k, "context": context,
          "T1_estimated": T1, "Tk_estimated": Tk, "Tk_over_T1": Tk / T1 if timed else None,
          "a_batch_measured_on_cpu": a["a_batch"], "a_measured_on_cpu": a["a"],
          "S_predicted": a["a_batch"] * T1 / Tk if timed else None,
          "peak_bytes_1": one["peak_bytes"], "peak_bytes_k": many["peak_bytes"],
          "compiler_flops_1": one["compiler_flops"], "compiler_flops_k": many["compiler_flops"],
          "compiler_bytes_1": one["compiler_bytes_accessed"],
          "compiler_bytes_k": many["compiler_bytes_accessed"],
          "while_loops": one["while_loops"] + many["while_loops"],
          **gpu, "compile_seconds": round(time.perf_counter() - t0, 1)})
      print(json.dumps(runs[-1]), flush=True)
  what = ("XLA:TPU cost_analysis optimal_seconds (the compiler's roofline estimate, every scan "
          "unrolled), not a measurement" if device.platform == "tpu" else
          f"not the compiler's time ({aot.compiler_name(device)}'s cost_analysis() gives none): "
          "aot.gpu_step_seconds, a model of ours from each forward as XLA:GPU compiled it "
          "(every scan unrolled): its kernels x launch_seconds_assumed + its argument bytes "
          "(params, cache) at the device's memory bandwidth; *_bandwidth_only without the "
          "launches; not a measurement")
  return {
      "target": target_text, "compiler": aot.compiler_name(device),
      "compiler_version": aot.compiler_version(device),
      "device_kind": device.device_kind, "device": aot.device_description(device),
      "dtype": dtype, "estimate": aot.estimate_note(device),
      "what": what + "; the unembedding aside, as decode.forward_seconds",
      "acceptance_from": os.path.relpath(acceptance_path),
      "acceptance_note": f"a_batch measured on CPU by bench_decode.py (greedy, {k} heads, "
                         f"prompt_len {acceptance_prompt_len}, step {accepted[1].get('step')}) "
                         f"on the model of {os.path.relpath(acceptance_path)}",
      "runs": runs}
