"""Does a config fit on my chips, and what does MTP cost in memory? Answered on a CPU, before
renting the chips.

    python experiments/plan_memory.py --config configs/paper_7b_n4.py --devices 256 \
        --mesh fsdp=256 [--batch 1024] [--hbm_gib 16] [--json plan.json] [--set model.x=...]
    python experiments/plan_memory.py --config configs/paper_7b_n4.py --target tpu:v5e:16x16 \
        --mesh fsdp=256 --json plan_tpu.json      # XLA:TPU, with libtpu (make .venv-tpu)
    python experiments/plan_memory.py --config configs/paper_7b_n4.py --target gpu:h200:8 \
        --mesh fsdp=8 --json plan_gpu.json        # XLA:GPU, with the CUDA plugin (.venv-gpu)

Simulates `--devices` CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count, set before
jax starts; the script re-executes itself if jax was already imported), builds the config's mesh,
and compiles the real train step (forward, MTP loss, backward, optimizer update; donated state;
the shardings `train.py` uses) on abstract shapes only: `jax.ShapeDtypeStruct`s carrying the
shardings of `steps.abstract_state` and `sharding.batch_sharding`, then `.lower().compile()`.
Nothing is allocated. `memory_analysis()` of the compiled SPMD program is per device: argument,
output, aliased (outputs written into donated arguments) and temp bytes. The same again for
n_future = 1 with the same n_layers, which for parallel heads is the matched-parameter
next-token model (Gloeckle et al. 2024 §3); the difference is what MTP costs.

Peak per device ~ arguments + temp + (outputs - aliased). An estimate, not a guarantee: this
is XLA:CPU's buffer assignment and scheduling, not the TPU or GPU compiler's (fusion, layouts,
bf16 handling differ; nothing here has been checked against a real chip), and the runtime
keeps its own reserve. `--hbm_gib` defaults to 16, a TPU v5e chip; a v4 or v6e chip has 32, a
v5p 95, an H100 80. To see what fills `temp`, add XLA_FLAGS="--xla_dump_to=DIR
--xla_dump_hlo_as_text" and read DIR/*jit_train_step*buffer-assignment.txt (largest values
first): an unsharded all-gather or a stack of [S, S] attention scores shows at once.
Each compile of a 7B or 13B model for 256 devices took 25-55 s on a busy 2-core CPU (1.4-1.8 GB
of host memory); scanned layers keep it flat in depth.

`--target tpu:TOPOLOGY` (tpu:v5e:16x16, tpu:v5p:4x4x4, tpu:v6e:8x8, ...) compiles for a real TPU
slice instead, on this CPU host (mtp_jax.aot: libtpu's topology gives the abstract chips, the
mesh is built from them, XLA:TPU compiles; attention_impl auto picks splash, the target's
kernel). Memory is then XLA:TPU's buffer assignment, per chip; `--hbm_gib` defaults to the
chip's; and the record adds the compiler's roofline time for the step (`optimal_seconds` of
`cost_analysis()`) and the MFU it implies (flops.py's model FLOPs over optimal_seconds x the
datasheet peak): the TPU compiler's estimate, not a measured time. ~80 s a 7B compile.

`--target gpu:h100|h200[:N|HxN|PxHxN]` compiles with XLA:GPU for N GPUs per host (H hosts), on
this CPU host with no GPU (mtp_jax.aot: the CUDA plugin's topology from a GpuTargetConfig;
attention_impl auto picks cudnn, whose flash-attention calls each record counts). Memory is
XLA:GPU's, per GPU, and `--hbm_gib` defaults to the GPU's memory. XLA:GPU's cost_analysis()
gives nothing, so a GPU record has no step time (optimal_seconds null, said in the record).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from experiments import common  # jax-free, as aot
from mtp_jax import aot  # jax-free: the device count and the TPU env are set before jax starts

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", required=True, help="an ml_collections config file")
  p.add_argument("--target", default="cpu", help=aot.TARGET_HELP)
  p.add_argument("--devices", type=int, default=0, help="simulated devices (chips): required "
                 "for --target cpu; a TPU or GPU target's are its topology's")
  p.add_argument("--mesh", default="", help="axis sizes, e.g. fsdp=256 or data=2,fsdp=128; "
                 "axes not named keep the config's value (one -1 fills)")
  p.add_argument("--batch", type=int, default=0, help="global batch (train.batch_size); "
                 "0 keeps the config's")
  p.add_argument("--hbm_gib", type=float, default=0.0,
                 help="memory per chip, GiB (default: a TPU or GPU target's device; else 16, a "
                 "TPU v5e; v4/v6e 32, v5p 95)")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="config override, repeatable: --set model.d_model=64")
  p.add_argument("--no_baseline", action="store_true", help="skip the n_future = 1 compile")
  p.add_argument("--cost", choices=("depth", "full", "none"), default="depth",
                 help="XLA:TPU's step time: one micro-batch compiled with every scan unrolled, "
                 "the trunk 1 and 2 blocks deep and extrapolated (depth), or all of it (full: "
                 "slow); none skips it")
  p.add_argument("--cost_only", action="store_true", help="add the --cost fields to the "
                 "records already in --json (an earlier run's), skipping the memory compiles")
  p.add_argument("--json", default="", help="write the records here")
  return p.parse_args(argv)


def ensure_devices(n: int) -> None:
  """XLA reads the device count once, when jax starts: set it first, or start again."""
  flags = os.environ.get("XLA_FLAGS", "")
  want = f"{_COUNT_FLAG}={n}"
  if want in flags.split() and "jax" not in sys.modules:
    return
  os.environ["XLA_FLAGS"] = " ".join(re.sub(rf"{_COUNT_FLAG}=\d+", "", flags).split() + [want])
  os.environ["JAX_PLATFORMS"] = "cpu"  # simulated CPU devices even on a GPU/TPU machine
  if "jax" in sys.modules:
    if os.environ.get("MTP_JAX_PLAN_REEXEC"):
      raise RuntimeError("plan_memory: jax was imported before the device count could be set")
    os.environ["MTP_JAX_PLAN_REEXEC"] = "1"
    cmd, env = common.module_command("plan_memory")
    os.execve(sys.executable, cmd + sys.argv[1:], env)


def parse_mesh(mesh: str) -> dict[str, int]:
  """--mesh "data=2,fsdp=4" -> {"data": 2, "fsdp": 4}; ValueError naming --mesh."""
  out = {}
  for item in filter(None, mesh.split(",")):
    axis, _, size = item.partition("=")
    if axis.strip() not in ("data", "fsdp", "tensor") or not size.strip().lstrip("-").isdigit():
      raise ValueError(f"--mesh: expected data=N, fsdp=N or tensor=N, got {item!r}")
    out[axis.strip()] = int(size)
  return out


def load_config(path: str, overrides: list[str], mesh: str, batch: int):
  from mtp_jax.config import load_file  # (jax first)
  c = load_file(path)
  common.apply_overrides(c, overrides)
  for axis, size in parse_mesh(mesh).items():
    c.mesh[axis] = size
  if batch:
    c.train.batch_size = batch
  return c


def _compile_step(model, tx, c, mesh, state, rows: int, options=None):
  import jax
  import jax.numpy as jnp
  from mtp_jax import sharding as shard_lib
  from mtp_jax import steps as steps_lib
  state_sh = jax.tree.map(lambda s: s.sharding, state)
  batch_sh = shard_lib.batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct((rows, c.data.seq_len), jnp.int32, sharding=batch_sh)
           for k in ("tokens", "segment_ids")}
  # Built outside the mesh context: make_train_step makes a jnp array eagerly, which under the
  # mesh would be placed on its devices (abstract ones, for a TPU topology: an error).
  step = jax.jit(steps_lib.make_train_step(model, tx, c), in_shardings=(state_sh, batch_sh),
                 out_shardings=(state_sh, None), donate_argnums=0)
  with shard_lib.activation_rules(mesh, c):  # traced here: attention picks the mesh's kernel
    return step.lower(state, batch).compile(options)


def step_cost(c, n_trunk: int, mesh, model_flops: float, how) -> dict:
  """XLA:TPU's roofline time for a train step of `c`. cost_analysis counts a loop body once, so
  one micro-batch (grad_accum 1) is compiled with every scan unrolled and counted grad_accum
  times (the optimizer update with it: a shard of the params, small against the micro-batch).
  Unrolled depth is what makes that compile slow: with `how` = "depth" the trunk is compiled 1
  and 2 blocks deep and the cost extrapolated linearly to n_trunk blocks (every block is the same
  program); "full" compiles all of it."""
  from mtp_jax import optimizer as optim_lib
  from mtp_jax import steps as steps_lib
  from mtp_jax.model import build_model
  A, B = c.train.grad_accum, c.train.batch_size
  device = mesh.devices.flat[0]
  depths = (n_trunk,) if how == "full" or n_trunk <= 2 else (1, 2)
  t0 = time.perf_counter()
  costs, loops = [], 0
  for depth in depths:
    cm = c.copy_and_resolve_references()
    cm.train.grad_accum, cm.train.batch_size = 1, B // A
    cm.model.n_layers = c.model.n_layers - n_trunk + depth
    model, tx = build_model(cm), optim_lib.make_optimizer(cm)
    state = steps_lib.abstract_state(model, tx, cm, mesh)
    with aot.unrolled_scans():
      compiled = _compile_step(model, tx, cm, mesh, state, B // A,
                               aot.cost_compiler_options(device))
    costs.append(aot.cost_record(compiled, device, c.model.dtype, None))
    if costs[-1]["optimal_seconds"] is None:
      raise ValueError(f"--cost: XLA:TPU gave no time for the step (optimal_seconds "
                       f"{costs[-1].get('optimal_seconds_invalid')})")
    loops += aot.while_loops(compiled)
  keys = ("optimal_seconds", "compiler_flops", "compiler_bytes_accessed")
  if len(costs) == 1:
    out = {k: A * costs[0][k] for k in keys}
  else:
    out = {k: A * (costs[0][k] + (costs[1][k] - costs[0][k]) * (n_trunk - 1)) for k in keys}
  peak = costs[0]["peak_flops_per_device"]
  out["mfu_at_optimal_seconds"] = model_flops / (out["optimal_seconds"] * peak) if peak else None
  # the compiler's time turned into throughput: tokens of one step per chip over it (an estimate)
  out["tokens_per_second_per_chip_at_optimal_seconds"] = (
      B * c.data.seq_len / mesh.devices.size / out["optimal_seconds"])
  out["cost_method"] = (
      f"one micro-batch ({B // A} rows) compiled with every scan unrolled, x {A} micro-batches; "
      + ("the whole trunk" if len(costs) == 1 else
         f"trunk 1 and 2 blocks deep, extrapolated linearly to {n_trunk}"))
  out["cost_while_loops"] = loops
  out["cost_compiler_options"] = aot.cost_compiler_options(device)
  out["cost_compile_seconds"] = round(time.perf_counter() - t0, 1)
  return out


def _variant(config, n_future: int):
  """`config` with `n_future` heads, resolved (this script's one check of each config it
  compiles: build_model checks nothing)."""
  from mtp_jax.config import parse_head_weights, validation
  c = config.copy_and_resolve_references()
  c.model.n_future = n_future
  if not isinstance(parse_head_weights(c.loss.head_weights), str):
    c.loss.head_weights = "uniform"  # a per-head list does not fit another head count
  return validation.resolve(c)


def add_cost(args, config, devices, how: str) -> None:
  """--cost_only: step_cost's fields added to the records of an earlier run's --json (same
  config, overrides and target), without compiling for memory again."""
  from mtp_jax import sharding as shard_lib
  from mtp_jax.model import build_model
  with open(args.json) as f:
    saved = json.load(f)
  if (saved.get("config"), saved.get("target"), saved.get("overrides")) != (
      args.config, args.target, args.set):
    raise ValueError(f"--cost_only: {args.json} was written for another --config, --target or "
                     "--set")
  for r in saved["records"]:
    c = _variant(config, r["n_future"])
    mesh = shard_lib.make_mesh(c, devices)
    r.update(step_cost(c, build_model(c).args.n_trunk, mesh, r["model_flops_per_device"], how))
    print(f"n_future={r['n_future']}: {r['compiler']} estimates {r['optimal_seconds']:.4g} s per "
          f"step (not measured), MFU {100 * r['mfu_at_optimal_seconds']:.0f}% at that time",
          flush=True)
  with open(args.json, "w") as f:
    json.dump(saved, f, indent=2)


def plan(config, n_future: int, devices=None, cost: str = "depth") -> dict:
  """Compiles the train step for `config` with `n_future` heads, for `devices` (default
  jax.devices(); a TPU topology's abstract devices compile with XLA:TPU); memory per device and
  the compiler's cost. Where the compiler gives a time (XLA:TPU), `cost` ("depth", "full"; ""
  skips it) compiles the step again for its cost: `step_cost`."""
  import jax
  import numpy as np
  from mtp_jax import flops as flops_lib
  from mtp_jax import optimizer as optim_lib
  from mtp_jax import sharding as shard_lib
  from mtp_jax import steps as steps_lib
  from mtp_jax.model import build_model

  c = _variant(config, n_future)
  model = build_model(c)
  tx = optim_lib.make_optimizer(c)
  mesh = shard_lib.make_mesh(c, devices)
  shard_lib.check_batch(c, mesh)
  state = steps_lib.abstract_state(model, tx, c, mesh)
  B, S = c.train.batch_size, c.data.seq_len
  t0 = time.perf_counter()
  compiled = _compile_step(model, tx, c, mesh, state, B)
  compile_s = time.perf_counter() - t0
  shard_bytes = lambda tree: sum(
      int(np.prod(s.sharding.shard_shape(s.shape))) * np.dtype(s.dtype).itemsize
      for s in jax.tree.leaves(tree))
  device = mesh.devices.flat[0]
  model_flops = flops_lib.flops_per_token(c)["total"] * B * S / mesh.devices.size
  loops_once = aot.cost_record(compiled, device, c.model.dtype, model_flops)
  rec = {
      **loops_once,
      "n_future": n_future,
      "head_kind": c.model.heads.kind,
      "n_params": int(sum(np.prod(s.shape) for s in jax.tree.leaves(state.params))),
      "mesh": dict(zip(shard_lib.AXES, (int(x) for x in mesh.devices.shape))),
      "devices": int(mesh.devices.size),
      "batch": B, "seq_len": S, "grad_accum": c.train.grad_accum,
      "dtype": c.model.dtype, "remat_policy": c.model.remat_policy,
      "attention_impl": c.model.attention_impl,
      "mosaic_kernel_calls": aot.mosaic_calls(compiled),  # splash attention on a TPU target
      "cudnn_attention_calls": aot.cudnn_attention_calls(compiled),  # a GPU target's flash
      "token_chunks": c.loss.token_chunks,
      "state_bytes_per_device": shard_bytes(state),
      **common.memory_record(compiled),  # argument, output, alias, temp and peak bytes
      "compile_seconds": round(compile_s, 1),
  }
  rec["optimal_seconds_loops_once"] = rec["optimal_seconds"]  # the memory compile's: too low
  rec["optimal_seconds"] = rec["mfu_at_optimal_seconds"] = None
  if cost and loops_once["optimal_seconds"] is not None:
    rec.update(step_cost(c, model.args.n_trunk, mesh, model_flops, cost))
  return rec


def report(records: list[dict], hbm_gib: float, config_path: str) -> str:
  first = records[0]
  big = max(r["peak_bytes"] for r in records) >= 2**30
  unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
  gib = lambda b: f"{b / scale:.2f}"
  mesh = " ".join(f"{k}={v}" for k, v in first["mesh"].items())
  count = lambda n: f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
  lines = [
      f"{config_path}: {first['head_kind']} heads, {count(first['n_params'])} params, "
      f"mesh {mesh} ({first['devices']} {first['device_kind']} devices"
      f"{', simulated' if first['compiler'] == 'XLA:CPU' else ', abstract'}), compiled by "
      f"{first['compiler']}, batch {first['batch']} x {first['seq_len']} (grad_accum "
      f"{first['grad_accum']}), {first['dtype']}, remat {first['remat_policy']}",
      "",
      f"| {unit} per device | " + " | ".join(f"n_future={r['n_future']}" for r in records)
      + (" | MTP extra |" if len(records) == 2 else " |"),
      "|---|" + "---|" * (len(records) + (len(records) == 2)),
  ]
  for key, label in (("state_bytes_per_device", "train state (params + opt)"),
                     ("argument_bytes", "arguments"), ("output_bytes", "outputs"),
                     ("alias_bytes", "aliased (donated)"), ("temp_bytes", "temp"),
                     ("peak_bytes", "peak = args + temp + outputs - aliased")):
    row = [gib(r[key]) for r in records]
    if len(records) == 2:
      row.append(f"{(records[0][key] - records[1][key]) / scale:+.2f}")
    lines.append(f"| {label} | " + " | ".join(row) + " |")
  if len(records) == 2 and records[1]["n_params"] != first["n_params"]:
    lines.append(f"(n_future=1 has {count(records[1]['n_params'])} params: not matched)")
  lines.append("")
  for r in records:
    peak = r["peak_bytes"] / 2**30
    verdict = "fits in" if peak <= hbm_gib else "does NOT fit in"
    lines.append(f"n_future={r['n_future']}: peak {r['peak_bytes'] / scale:.2f} {unit} per device "
                 f"{verdict} {hbm_gib:g} GiB per chip ({100 * peak / hbm_gib:.0f}%; compiled in "
                 f"{r['compile_seconds']:.0f}s)")
  if first.get("cost_analysis"):
    lines.append(f"{first['compiler']}: {first['cost_analysis']} (no step-time estimate)")
  for r in records:
    if r["optimal_seconds"]:
      mfu = r["mfu_at_optimal_seconds"]
      lines.append(f"n_future={r['n_future']}: {r['compiler']} estimates "
                   f"{r['optimal_seconds']:.4g} s per step (cost_analysis optimal_seconds; not "
                   "measured)" + (f", MFU {100 * mfu:.0f}% at that time" if mfu else ""))
  return "\n".join(lines)


def gpus_from_mesh(target_text: str, mesh: str) -> str:
  """`gpu:NAME` with no count and a --mesh of P > 1 devices (e.g. fsdp=8): the GPU target of P
  GPUs, 8 per host as on an HGX node (gpu:h200 --mesh fsdp=8 -> gpu:h200:8, fsdp=16 ->
  gpu:h200:2x8); any other target as it is."""
  n = 1
  for size in parse_mesh(mesh).values():
    n *= max(size, 1)  # -1 (fill) names no count
  if not target_text.startswith("gpu:") or target_text.count(":") != 1 or n <= 1:
    return target_text
  return f"{target_text}:{n}" if n <= 8 or n % 8 else f"{target_text}:{n // 8}x8"


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  try:
    args.target = gpus_from_mesh(args.target, args.mesh)
    target = aot.parse_target(args.target)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if target[0] == "cpu":
    if args.devices < 1:
      print("error: --devices: must be >= 1 (the simulated CPU devices of --target cpu)",
            file=sys.stderr)
      return 2
    ensure_devices(args.devices)
  else:
    aot.prepare_env(target)
  try:
    devices = aot.target_devices(target) if target[0] != "cpu" else None
    if devices is not None and args.devices not in (0, len(devices)):
      raise ValueError(f"--devices: {args.target} has {len(devices)} devices, got "
                       f"{args.devices} (leave it out)")
    hbm = args.hbm_gib or (devices and aot.hbm_gib(devices[0])) or 16.0
    config = load_config(args.config, args.set, args.mesh, args.batch)
    cost = "" if args.cost == "none" else args.cost
    if args.cost_only:
      if not (cost and args.json and target[0] == "tpu"):
        raise ValueError("--cost_only: needs --json of an earlier run, a TPU --target and --cost")
      add_cost(args, config, devices, cost)
      return 0
    records = [plan(config, config.model.n_future, devices, cost)]
    if not args.no_baseline and config.model.n_future > 1:
      records.append(plan(config, 1, devices, cost))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for r in records:
    r["target"] = args.target
    r["hbm_gib"] = hbm
    r["fits"] = r["peak_bytes"] <= hbm * 2**30
  print(report(records, hbm, args.config), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      head = {"config": args.config, "target": args.target, "overrides": args.set,
              "compiler": records[0]["compiler"],
              "compiler_version": records[0]["compiler_version"]}
      if devices is not None:
        head["what"] = aot.estimate_note(devices[0])
        head["device"] = aot.device_description(devices[0])
      json.dump(common.stamp({**head, "records": records}), f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
