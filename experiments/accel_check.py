"""The parts of experiments/accel_check.sh (`make accel-check`) that are not another script's:

    python -m experiments.accel_check attention --json OUT.json [--seq 256]
    python -m experiments.accel_check memory --size 350m --json OUT.json [--target gpu:h200]
    python -m experiments.accel_check summary --dir experiments/results/nvidia_h200

attention: every attention kernel this device can run ("auto", its fused one, xla), causal,
with and without packed documents, bf16, against the einsum reference in float32: outputs and
the gradients of q, k, v, largest absolute error of each; a kernel passes below `--atol`
(relative errors; bf16's own rounding is ~2^-8). memory: bench_accel.py's train step of `--size` (4
parallel heads, bf16) compiled on this device (its compiled peak), then run once, and the
device's own `memory_stats()` peak_bytes_in_use beside it (none on a CPU); with `--target
gpu:h200` or `tpu:...` the same step compiled ahead of time instead, nothing run: the estimate
the device run is compared with. summary: one line per part from the JSONs of a run, the
memory beside experiments/results/aot_accel_check_<target>.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from experiments import common  # jax-free, as aot
from mtp_jax import aot

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
AOT_MEMORY = {"nvidia_h200": "aot_accel_check_h200.json",
              "nvidia_h100_80gb_hbm3": "aot_accel_check_h100.json"}


def device_tag(device) -> str:
  """experiments/results/<tag>/: the device kind, lower case, words joined by _."""
  return "_".join(device.device_kind.lower().replace("-", " ").split())


def check_attention(seq: int, atol: float) -> dict:
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np

  from mtp_jax import attention
  from mtp_jax.backends.platform import target_platform
  B, H, K, E = 2, 8, 2, 64
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (B, seq, H, E), jnp.float32)
  k, v = (jax.random.normal(x, (B, seq, K, E), jnp.float32) for x in keys[1:])
  pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (B, seq))
  packed = jnp.asarray(np.repeat(np.arange(1, 5), seq // 4)[None].repeat(B, 0), jnp.int32)
  fused = {"gpu": "cudnn", "tpu": "splash"}.get(target_platform())
  out = {"platform": target_platform(), "seq": seq, "atol": atol, "checks": []}
  for segments in (None, packed):
    ref = functools.partial(attention.einsum_attention, positions_BxS=pos,
                            segment_ids_BxS=segments, cached=False, dtype=jnp.float32)
    want = jax.value_and_grad(lambda *a, ref=ref: (ref(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    for impl in [x for x in ("auto", fused, "xla") if x]:
      used = attention.resolve(impl, cached=False, segments=segments is not None,
                               dtype=jnp.bfloat16)
      f = lambda *a, impl=impl, segments=segments: (attention.attend(
          *(x.astype(jnp.bfloat16) for x in a), pos, segments, cached=False, impl=impl,
          dtype=jnp.bfloat16).astype(jnp.float32) ** 2).sum()
      got = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)
      # the loss relative to its size, each gradient's largest error relative to its largest
      # element (bf16 inputs: ~2^-8 relative rounding)
      errs = [float(abs(got[0] - want[0]) / abs(want[0]))] + [
          float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) for g, w in zip(got[1], want[1])]
      out["checks"].append({"impl": impl, "used": used, "packed": segments is not None,
                            "loss_rel_err": errs[0], "grad_rel_err": errs[1:],
                            "pass": max(errs) < atol})
  out["pass"] = all(c["pass"] for c in out["checks"])
  return out


def check_memory(size: str, target_text: str) -> dict:
  import jax
  from experiments import bench_accel
  target = aot.parse_target(target_text) if target_text else None
  if target:
    aot.prepare_env(target)
    device = aot.target_devices(target)[0]
  else:
    device = jax.devices()[0]
  c = bench_accel.make_config(size, bench_accel.K, "bfloat16", bench_accel.SIZES[size][7], [])
  from mtp_jax import sharding as shard_lib
  from mtp_jax import steps as steps_lib
  training = steps_lib.build_training(c, shard_lib.make_mesh(c, devices=[device]))
  batch = common.random_batch(c)
  abstract = (training.abstract_state(), jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=training.batch_sharding), batch))
  with shard_lib.activation_rules(training.mesh, c):
    compiled = training.step.lower(*abstract).compile()
  rec = {"size": size, "batch": c.train.batch_size, "seq_len": c.data.seq_len, "n_future": 4,
         "dtype": "bfloat16", "device": aot.device_description(device),
         "compiler": aot.compiler_name(device), "compiler_version": aot.compiler_version(device),
         "target": target_text or "this device",
         "cudnn_attention_calls": aot.cudnn_attention_calls(compiled),
         "mosaic_kernel_calls": aot.mosaic_calls(compiled), **common.memory_record(compiled)}
  if target:
    rec["what"] = aot.estimate_note(device)
    return rec
  state = training.init_state(0)
  state, metrics = compiled(state, jax.device_put(batch, training.batch_sharding))
  jax.block_until_ready(metrics)
  stats = device.memory_stats()
  rec["memory_stats"] = stats
  rec["measured_peak_bytes_in_use"] = (stats or {}).get("peak_bytes_in_use")
  if rec["measured_peak_bytes_in_use"] is None:
    rec["memory_stats_note"] = f"{device.platform}: memory_stats() gives no peak here"
  return rec


def _load(path):
  with open(path) as f:
    return json.load(f)


def summary(folder: str) -> list[str]:
  lines = [f"accel-check: {folder}"]
  path = os.path.join(folder, "attention.json")
  if os.path.exists(path):
    a = _load(path)
    worst = max(max([c["loss_rel_err"]] + c["grad_rel_err"]) for c in a["checks"])
    lines.append(f"attention: {'PASS' if a['pass'] else 'FAIL'} ({len(a['checks'])} kernel "
                 f"checks on {a['platform']}, worst error {worst:.2g} against atol {a['atol']})")
  for path in sorted(glob.glob(os.path.join(folder, "bench_accel_*.json"))):
    b = _load(path)
    mfu = ", ".join(f"n={t['n_future']} {100 * t['mfu']:.1f}%" for t in b["train"])
    lines.append(f"train {b['size']} batch {b['batch']}: MFU {mfu}, step n=4/n=1 "
                 f"{b['step_ratio_n4_over_n1']:.2f}")
  for path in sorted(glob.glob(os.path.join(folder, "bench_decode*.json"))):
    runs = _load(path)
    best = max(runs, key=lambda r: r.get("S_measured") or 0)
    lines.append(f"decode ({os.path.basename(path)}): {len(runs)} records, best S measured "
                 f"{best.get('S_measured') or 0:.2f} ({best.get('variant')}, batch "
                 f"{best.get('batch')}, {best.get('mode', 'greedy')})")
  path = os.path.join(folder, "memory.json")
  if os.path.exists(path):
    m = _load(path)
    mib = lambda b: "none" if b is None else f"{b / 2**20:,.0f} MiB"
    line = (f"memory {m['size']} n=4: compiled here {mib(m['peak_bytes'])}, measured "
            f"{mib(m['measured_peak_bytes_in_use'])}")
    est = AOT_MEMORY.get(os.path.basename(os.path.normpath(folder)))
    if est and os.path.exists(os.path.join(RESULTS, est)):
      e = _load(os.path.join(RESULTS, est))
      line += f", ahead of time ({e['compiler']}, {e['target']}) {mib(e['peak_bytes'])}"
    else:
      line += ", no ahead-of-time estimate for this device"
    lines.append(line)
  return lines


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("part", choices=("attention", "memory", "summary"))
  ap.add_argument("--json", default=None)
  ap.add_argument("--seq", type=int, default=256, help="attention: sequence length")
  ap.add_argument("--atol", type=float, default=0.05, help="attention: largest error allowed")
  ap.add_argument("--size", default="350m", help="memory: a bench_accel.py size")
  ap.add_argument("--target", default="", help="memory: compile for this target instead "
                  f"({aot.TARGET_HELP})")
  ap.add_argument("--dir", default="", help="summary: the run's results folder")
  args = ap.parse_args(argv)
  if args.part == "summary":
    print("\n".join(summary(args.dir)))
    return 0
  if args.part == "attention":
    if args.seq < 4 or args.seq % 4:
      raise ValueError(f"--seq: got {args.seq}, allowed: a multiple of 4, at least 4")
    rec = check_attention(args.seq, args.atol)
  else:
    from experiments import bench_accel
    if args.size not in bench_accel.SIZES:
      raise ValueError(f"--size: got {args.size!r}, allowed: {', '.join(bench_accel.SIZES)}")
    rec = check_memory(args.size, args.target)
  common.emit(rec, args.json)
  return 0 if rec.get("pass", True) else 1


if __name__ == "__main__":
  try:
    sys.exit(main())
  except ValueError as e:
    sys.exit(f"error: {e}")
