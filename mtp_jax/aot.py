"""Compiling for accelerators that are not here: `--target tpu:v5e:16x16` in plan_memory.py and
bench_accel.py.

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
"""

from __future__ import annotations

import contextlib
import os
import re

COMPILERS = {"cpu": "XLA:CPU", "gpu": "XLA:GPU", "tpu": "XLA:TPU"}

# HBM per device (chip) in GiB, by device kind as jax names it; Cloud TPU docs
# (cloud.google.com/tpu/docs/v5e, v5p, v6e). v4 is left out: its topologies count 2 devices per
# chip here, and a per-device figure would be a guess.
HBM_GIB = {"TPU v5 lite": 16.0, "TPU v5": 95.0, "TPU v6 lite": 32.0}

# TPU_ACCELERATOR_TYPE per generation, so that libtpu does not try to discover a TPU VM's hosts
# (it warns, and queries a metadata server) on a machine that is not one.
_ACCELERATOR_TYPE = {"v4": "v4-8", "v5e": "v5litepod-4", "v5p": "v5p-8", "v6e": "v6e-4"}
_TARGET_RE = re.compile(r"^tpu:([a-z0-9]+):(\d+(?:x\d+)*)$")
TARGET_HELP = ("cpu (simulated CPU devices, XLA:CPU), or tpu:TOPOLOGY, e.g. tpu:v5e:16x16, "
               "tpu:v5p:4x4x4, tpu:v6e:8x8 (XLA:TPU ahead of time; needs libtpu)")


def parse_target(text: str) -> tuple[str, str | None]:
  if text == "cpu":
    return "cpu", None
  m = _TARGET_RE.match(text)
  if not m:
    raise ValueError(f"--target: got {text!r}, allowed: {TARGET_HELP}")
  return "tpu", f"{m.group(1)}:{m.group(2)}"


def prepare_env(target: tuple[str, str | None]) -> None:
  """For a TPU target, before jax starts: keep jax's own backend the CPU (there is no chip),
  and tell libtpu this is no TPU VM. Values the caller set win."""
  platform, topology = target
  if platform != "tpu":
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # libtpu takes /tmp/libtpu_lockfile, so a second process (another compile, a test) fails with
  # "Internal error when accessing libtpu multi-process lockfile"; no chip is used here.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE",
                        _ACCELERATOR_TYPE.get(topology.split(":")[0], "v5litepod-4"))


def target_devices(target: tuple[str, str | None]) -> list:
  """The topology's abstract devices (a TPU target); ValueError naming --target if libtpu is
  missing or does not know the topology."""
  platform, topology = target
  if platform != "tpu":
    raise ValueError(f"--target: {platform!r} has no topology to compile for")
  import jax
  from jax.experimental import topologies
  try:
    import libtpu  # noqa: F401
  except ImportError:
    raise ValueError(f"--target tpu:{topology}: libtpu is not installed; install "
                     f"\"jax[tpu]=={jax.__version__}\" in a venv of its own (make .venv-tpu)"
                     ) from None
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
  except jax.errors.JaxRuntimeError as e:
    raise ValueError(f"--target tpu:{topology}: libtpu refused it "
                     f"({str(e).splitlines()[0]})") from None


def compiler_name(device) -> str:
  return COMPILERS.get(device.platform, f"XLA:{device.platform.upper()}")


def compiler_version(device) -> str:
  """The compiler behind a record: libtpu's version on a TPU target (the XLA:TPU that compiled),
  jaxlib's otherwise."""
  from importlib import metadata
  package = "libtpu" if device.platform == "tpu" else "jaxlib"
  try:
    return f"{package} {metadata.version(package)}"
  except metadata.PackageNotFoundError:
    return f"{package} (version unknown)"


ESTIMATE_NOTE = ("compile-time figures of the compiler (memory_analysis, cost_analysis "
                 "optimal_seconds) for abstract chips on a CPU host; not measured on a TPU")


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
  raw = cost.get("optimal_seconds")
  seconds = float(raw) if raw is not None and raw > 0 else None
  peak = flops_lib.PEAK_FLOPS.get(device.device_kind)
  peak = None if peak is None else peak[0 if dtype == "bfloat16" else 1]
  rec = {"compiler": compiler_name(device), "compiler_version": compiler_version(device),
         "device_kind": device.device_kind,
         "compiler_flops": float(cost.get("flops", 0.0)),
         "compiler_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
         "optimal_seconds": seconds, "peak_flops_per_device": peak,
         "model_flops_per_device": model_flops_per_device, "mfu_at_optimal_seconds": None}
  if raw is not None and seconds is None:  # no time: an op without a cost (see above)
    rec["optimal_seconds_invalid"] = float(raw)
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


def mosaic_calls(compiled) -> int:
  """Pallas TPU (Mosaic) kernels in a compiled program, e.g. the splash attention kernel."""
  return compiled.as_text().count('custom_call_target="tpu_custom_call"')
