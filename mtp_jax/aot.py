"""Compiling for accelerators that are not here: `--target tpu:v5e:16x16` or `--target gpu:h200:8`
in plan_memory.py and bench_accel.py.

    from mtp_jax import aot
    target = aot.parse_target("tpu:v5e:2x2")  # ("tpu", "v5e:2x2"); "cpu" -> ("cpu", None)
    aot.prepare_env(target)                   # before jax starts
    devices = aot.target_devices(target)      # 4 abstract TPU v5e chips (libtpu's topology)
    mesh = sharding.make_mesh(config, devices)
    with sharding.activation_rules(mesh, config):
      compiled = jax.jit(step, ...).lower(*abstract_args).compile()  # XLA:TPU, on this host
    aot.cost_record(compiled, devices[0], dtype, model_flops_per_device)

`jax.experimental.topologies.get_topology_desc` asks libtpu for a topology's devices; nothing
runs on them, but `.lower().compile()` runs the real XLA:TPU compiler (and Mosaic for Pallas
kernels) on a CPU host, and the executable's `memory_analysis()` (per chip) and
`cost_analysis()` (per chip; on TPU with the compiler's roofline `optimal_seconds`) can be read.
Those are the compiler's estimates, never measurements. Trap: cost_analysis counts a while
loop's body once, whatever its trip count (XLA:TPU, a 10-step fori_loop of matmuls: the FLOPs
of one step), so the scanned layers, heads, loss tiles and micro-batches of a train step are
counted once each; `unrolled_scans()` unrolls every lax.scan while a program is traced for its
cost (`while_loops` counts what is left). libtpu comes with `pip install
"jax[tpu]==<jax's version>"` (the `tpu` extra); `make .venv-tpu` puts it in a venv of its own,
because an installed libtpu changes jax's plugin discovery for everything else.

GPU targets (`gpu:h100`, `gpu:h200:8`, `gpu:h200:2x8`): the CUDA PJRT plugin builds a topology
from a GpuTargetConfig text (`gpu_target_config`: the device description XLA:GPU compiles for)
and a shape "partitions x hosts x GPUs per host"; XLA:GPU then compiles on this CPU host with
no GPU and no driver (JAX_PLATFORMS=cpu, CUDA_VISIBLE_DEVICES=-1, autotuning off: there is no
device to time kernels on). `memory_analysis()` is per GPU; `cost_analysis()` returns None, so
a GPU record has no optimal_seconds. The plugin (`jax-cuda12-plugin`) and cuDNN
(`nvidia-cudnn-cu12`, whose version the cuDNN attention lowering checks) live in `.venv-gpu`
(`make .venv-gpu/.installed`), out of the main venv as libtpu is.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

COMPILERS = {"cpu": "XLA:CPU", "gpu": "XLA:GPU", "tpu": "XLA:TPU"}

# HBM per device (chip) in GiB, by device kind as jax names it; Cloud TPU docs
# (cloud.google.com/tpu/docs/v5e, v5p, v6e). v4 is left out: its topologies count 2 devices per
# chip here, and a per-device figure would be a guess.
HBM_GIB = {"TPU v5 lite": 16.0, "TPU v5": 95.0, "TPU v6 lite": 32.0}

# What XLA:GPU compiles for, per GPU: fields of stream_executor.GpuDeviceInfoProto. h100 is XLA's
# own spec of an H100 SXM 80 GB (xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb, a device's
# CreateDeviceDescription). h200 is that spec with what differs on an H200 SXM by NVIDIA's
# datasheet (4.8 TB/s HBM3e; the same GH100 die: 132 SMs, 50 MB L2) and the memory an H200 reports
# (143771 MiB in nvidia-smi); no H200 description was read from a device here.
_H100 = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
         "shared_memory_per_block": 49152, "shared_memory_per_core": 233472,
         "threads_per_core_limit": 2048, "core_count": 132, "fpus_per_core": 128,
         "block_dim_limit_x": 2147483647, "block_dim_limit_y": 65535,
         "block_dim_limit_z": 65535, "memory_bandwidth": 3352320000000,
         "l2_cache_size": 52428800, "clock_rate_ghz": 1.98, "device_memory_size": 84978434048,
         "shared_memory_per_block_optin": 232448, "registers_per_core_limit": 65536,
         "registers_per_block_limit": 65536}
GPUS = {
    "h100": ("NVIDIA H100 80GB HBM3", _H100),
    "h200": ("NVIDIA H200", {**_H100, "memory_bandwidth": 4800000000000,
                             "device_memory_size": 143771 * 2**20}),
}
HBM_GIB.update({kind: info["device_memory_size"] / 2**30 for kind, info in GPUS.values()})

# TPU_ACCELERATOR_TYPE per generation, so that libtpu does not try to discover a TPU VM's hosts
# (it warns, and queries a metadata server) on a machine that is not one.
_ACCELERATOR_TYPE = {"v4": "v4-8", "v5e": "v5litepod-4", "v5p": "v5p-8", "v6e": "v6e-4"}
_TARGET_RE = re.compile(r"^tpu:([a-z0-9]+):(\d+(?:x\d+)*)$")
_GPU_TARGET_RE = re.compile(rf"^gpu:({'|'.join(GPUS)})(?::([1-9]\d*(?:x[1-9]\d*){{0,2}}))?$")
TARGET_HELP = ("cpu (simulated CPU devices, XLA:CPU), tpu:TOPOLOGY, e.g. tpu:v5e:16x16, "
               "tpu:v5p:4x4x4, tpu:v6e:8x8 (XLA:TPU ahead of time; needs libtpu), or "
               f"gpu:{'|'.join(GPUS)}[:N|HxN|PxHxN], e.g. gpu:h200:8 for one host of 8 GPUs "
               "(XLA:GPU ahead of time; needs the CUDA plugin: make .venv-gpu/.installed)")


def parse_target(text: str) -> tuple[str, str | None]:
  """("cpu", None), ("tpu", "v5e:2x2") or ("gpu", "h200:1x1x8"): a GPU topology is always
  "partitions x hosts x GPUs per host" (gpu:h200 is one GPU, gpu:h200:8 one host of 8)."""
  if text == "cpu":
    return "cpu", None
  m = _TARGET_RE.match(text)
  if m:
    return "tpu", f"{m.group(1)}:{m.group(2)}"
  m = _GPU_TARGET_RE.match(text)
  if m:
    shape = (m.group(2) or "1").split("x")
    return "gpu", f"{m.group(1)}:{'x'.join(['1'] * (3 - len(shape)) + shape)}"
  raise ValueError(f"--target: got {text!r}, allowed: {TARGET_HELP}")


def prepare_env(target: tuple[str, str | None]) -> None:
  """Before jax starts, for a TPU or GPU target: keep jax's own backend the CPU (there is no
  chip); tell libtpu this is no TPU VM; hide any GPU from the CUDA plugin and turn XLA:GPU's
  autotuning off (it times kernels on a device). Values the caller set win."""
  platform, topology = target
  if platform == "cpu":
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "jax" in sys.modules:  # imported already (a test's conftest): jax read the env back then
    import jax
    if not jax.config.jax_platforms:  # else the CUDA plugin looks for a CUDA runtime and fails
      jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
  if platform == "gpu":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_gpu_autotune_level" not in flags:
      os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_autotune_level=0".strip()
    return
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # libtpu takes /tmp/libtpu_lockfile, so a second process (another compile, a test) fails with
  # "Internal error when accessing libtpu multi-process lockfile"; no chip is used here.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE",
                        _ACCELERATOR_TYPE.get(topology.split(":")[0], "v5litepod-4"))


# What each target platform needs installed: (module, what installs it).
_NEEDS = {"tpu": (("libtpu", "\"jax[tpu]=={jax}\" in a venv of its own (make .venv-tpu)"),),
          "gpu": (("jax_cuda12_plugin", "\"jax[cuda12-local]=={jax}\" (the gpu-aot extra) in a "
                   "venv of its own (make .venv-gpu/.installed)"),
                  ("nvidia.cudnn", "nvidia-cudnn-cu12 (make .venv-gpu/.installed)"))}


def cudnn_version() -> str | None:
  """The version of the cuDNN the CUDA plugin loads (what the cuDNN attention lowering checks),
  e.g. "9.28.0"; None without the plugin or cuDNN."""
  try:
    from jax_cuda12_plugin import _versions
    v = _versions.cudnn_get_version()  # cuDNN 9: major * 10000 + minor * 100 + patch
  except (ImportError, RuntimeError):
    return None
  return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def gpu_target_config(name: str) -> str:
  """The GpuTargetConfigProto text XLA:GPU compiles `name` (a GPUS key) for: the device info,
  the CUDA platform, and the installed cuDNN's version as the DNN the target has."""
  kind, info = GPUS[name]
  fields = "".join(f"  {k}: {v}\n" for k, v in info.items())
  dnn = cudnn_version()
  dnn = "" if dnn is None else "dnn_version_info {{ major: {} minor: {} patch: {} }}\n".format(
      *dnn.split("."))
  return (f"gpu_device_info {{\n{fields}  cuda_compute_capability {{ major: 9 minor: 0 }}\n}}\n"
          f'platform_name: "CUDA"\n{dnn}device_description_str: "{kind}"\n')


def target_devices(target: tuple[str, str | None]) -> list:
  """The topology's abstract devices (a TPU or GPU target); ValueError naming --target if the
  compiler (libtpu, the CUDA plugin and cuDNN) is missing or refuses the topology."""
  platform, topology = target
  if platform not in _NEEDS:
    raise ValueError(f"--target: {platform!r} has no topology to compile for")
  import importlib.util
  import jax
  from jax.experimental import topologies
  for module, how in _NEEDS[platform]:
    if importlib.util.find_spec(module.split(".")[0]) is None or (
        "." in module and importlib.util.find_spec(module) is None):
      raise ValueError(f"--target {platform}:{topology}: {module} is not installed; install "
                       + how.format(jax=jax.__version__))
  try:
    if platform == "tpu":
      topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    else:
      name, shape = topology.split(":")
      topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(name),
                                          topology=shape)
    return list(topo.devices)
  except jax.errors.JaxRuntimeError as e:
    compiler = "libtpu" if platform == "tpu" else "the CUDA plugin"
    raise ValueError(f"--target {platform}:{topology}: {compiler} refused it "
                     f"({str(e).splitlines()[0]})") from None


def compiler_name(device) -> str:
  return COMPILERS.get(device.platform, f"XLA:{device.platform.upper()}")


# The package whose XLA compiled for a platform (jaxlib's for the CPU).
_COMPILER_PACKAGES = {"tpu": "libtpu", "gpu": "jax-cuda12-plugin"}


def compiler_version(device) -> str:
  """The compiler behind a record: libtpu's version on a TPU target (the XLA:TPU that compiled),
  the CUDA plugin's on a GPU target (XLA:GPU), jaxlib's otherwise."""
  from importlib import metadata
  package = _COMPILER_PACKAGES.get(device.platform, "jaxlib")
  try:
    return f"{package} {metadata.version(package)}"
  except metadata.PackageNotFoundError:
    return f"{package} (version unknown)"


ESTIMATE_NOTE = ("compile-time figures of the compiler (memory_analysis, cost_analysis "
                 "optimal_seconds) for abstract chips on a CPU host; not measured on a TPU")
GPU_ESTIMATE_NOTE = ("compile-time figures of XLA:GPU (memory_analysis, per GPU) for abstract "
                     "GPUs on a CPU host with no GPU; not measured on a GPU. XLA:GPU's "
                     "cost_analysis() gives nothing here, so there is no compiler time "
                     "(optimal_seconds null)")
NO_COST_NOTE = "cost_analysis() returned nothing: no compiler time for this target"


def estimate_note(device) -> str:
  return GPU_ESTIMATE_NOTE if device.platform == "gpu" else ESTIMATE_NOTE


def device_description(device) -> dict:
  """What the compiler was told the device is: a GPU target's GpuTargetConfig fields (and the
  cuDNN version in it), else the device kind."""
  out = {"device_kind": device.device_kind, "platform": device.platform}
  gpu = next((name for name, (kind, _) in GPUS.items() if kind == device.device_kind), None)
  if device.platform == "gpu" and gpu is not None:
    info = GPUS[gpu][1]
    out.update(gpu=gpu, compute_capability="9.0", sms=info["core_count"],
               memory_bandwidth_bytes_per_s=info["memory_bandwidth"],
               device_memory_bytes=info["device_memory_size"], l2_cache_bytes=info["l2_cache_size"],
               clock_rate_ghz=info["clock_rate_ghz"], cudnn=cudnn_version())
  return out


# XLA:TPU's cost analysis has no cost for the ConcatBitcast custom call that memory-space
# assignment's sliced prefetches emit: each one adds -1 s to optimal_seconds (a 125m decode
# forward with two trunk blocks: -0.99975 s; with sliced prefetch off: 257 us). Compiles made for
# their cost turn sliced prefetch off.
COST_COMPILER_OPTIONS = {"xla_tpu_sliced_prefetch_max_slices": 0}


def cost_compiler_options(device) -> dict:
  """compiler_options for `.compile()` of a program compiled for its cost_analysis."""
  return dict(COST_COMPILER_OPTIONS) if device.platform == "tpu" else {}


def hbm_gib(device) -> float | None:
  return HBM_GIB.get(device.device_kind)


def cost_record(compiled, device, dtype: str, model_flops_per_device: float | None) -> dict:
  """The compiler's per-device cost of `compiled`: its FLOP and byte counts and, on XLA:TPU, its
  roofline time `optimal_seconds`, with the MFU that time implies (model FLOPs per device over
  optimal_seconds x the datasheet peak of flops.PEAK_FLOPS). An estimate of the compiler, not a
  measurement: None where the compiler gives no time (XLA:CPU)."""
  from mtp_jax import flops as flops_lib
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  counted = bool(cost)
  raw = cost.get("optimal_seconds")
  seconds = float(raw) if raw is not None and raw > 0 else None
  peak = flops_lib.PEAK_FLOPS.get(device.device_kind)
  peak = None if peak is None else peak[0 if dtype == "bfloat16" else 1]
  rec = {"compiler": compiler_name(device), "compiler_version": compiler_version(device),
         "device_kind": device.device_kind,
         "compiler_flops": float(cost.get("flops", 0.0)) if counted else None,
         "compiler_bytes_accessed": float(cost.get("bytes accessed", 0.0)) if counted else None,
         "optimal_seconds": seconds, "peak_flops_per_device": peak,
         "model_flops_per_device": model_flops_per_device, "mfu_at_optimal_seconds": None}
  if raw is not None and seconds is None:  # no time: an op without a cost (see above)
    rec["optimal_seconds_invalid"] = float(raw)
  if not counted:  # XLA:GPU (and XLA:CPU) executables here: say so rather than show zeros
    rec["cost_analysis"] = NO_COST_NOTE
  if seconds and peak and model_flops_per_device:
    rec["mfu_at_optimal_seconds"] = model_flops_per_device / (seconds * peak)
  return rec


@contextlib.contextmanager
def unrolled_scans():
  """While a program is traced inside, every jax.lax.scan (flax's nn.scan and the loss's scans
  included: they call it through the module) is fully unrolled, so that cost_analysis, which
  counts a loop body once, sees every iteration. The maths is the same; compile time and
  program size grow with the trip counts."""
  import jax
  scan = jax.lax.scan

  def unrolled(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
    del unroll
    return scan(f, init, xs, length=length, reverse=reverse, unroll=True, **kw)

  jax.lax.scan = unrolled
  try:
    yield
  finally:
    jax.lax.scan = scan


def while_loops(compiled) -> int:
  """While loops left in a compiled program (each one's body is counted once by cost_analysis).
  """
  return len(re.findall(r"= [^=\n]*\bwhile\(", compiled.as_text()))


# Ops of a compiled XLA:GPU program that launch nothing: views, tuples and the program's inputs.
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "bitcast", "tuple"}

# Host-side cost of one kernel launch by XLA:GPU's runtime, the figure `gpu_step_seconds`
# assumes: NVIDIA quotes a few microseconds per launch; a measured value would replace it.
GPU_LAUNCH_SECONDS = 3e-6


def gpu_kernels(compiled) -> int:
  """Kernels one call of a program compiled by XLA:GPU launches: the instructions of its entry
  computation other than views, tuples and parameters (fusions, cuBLAS calls, copies). Only for
  a program without while loops (`unrolled_scans`), whose bodies would run many times."""
  text = compiled.as_text()
  if while_loops(compiled):
    raise ValueError("gpu_kernels: the program has while loops; compile it with unrolled_scans")
  entry = text[text.index("\nENTRY"):]
  # name = shape opcode(...): a tuple shape, "(f32[8]{0}, s8[4]{0})", holds spaces
  ops = re.findall(r"^\s*(?:ROOT )?%?\S+ = (?:\([^()]*\)|\S+) ([a-z][a-z0-9\-]*)\(", entry,
                   flags=re.M)
  return sum(op not in _NO_KERNEL for op in ops)


def gpu_step_seconds(kernels: int, bytes_read: int, device_kind: str,
                     launch_seconds: float = GPU_LAUNCH_SECONDS) -> float:
  """A model of a small program's time on a GPU, ours and not the compiler's (XLA:GPU's
  cost_analysis gives none here): its kernels launched one after another at `launch_seconds`
  each, plus `bytes_read` at the device's memory bandwidth (the GpuTargetConfig's)."""
  bandwidth = next(info["memory_bandwidth"] for kind, info in GPUS.values()
                   if kind == device_kind)
  return kernels * launch_seconds + bytes_read / bandwidth


def mosaic_calls(compiled) -> int:
  """Pallas TPU (Mosaic) kernels in a compiled program, e.g. the splash attention kernel."""
  return compiled.as_text().count('custom_call_target="tpu_custom_call"')


def cudnn_attention_calls(compiled) -> int:
  """cuDNN fused (flash) attention calls in a program compiled by XLA:GPU, forward and backward
  (custom call targets __cudnn$fmha...)."""
  return len(re.findall(r'custom_call_target="__cudnn\$fmha', compiled.as_text()))
