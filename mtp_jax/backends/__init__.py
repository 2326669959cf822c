"""Platform backends: the code that exists only for one platform's speed, apart from the core.

The core (layers, model, loss, steps, decoding) asks `current()` while tracing and calls what it
returns, as `attention.resolve` picks a kernel: the CPU backend (`backends.cpu.ops`) when the
code compiles for XLA:CPU (`platform.target_platform`), else `generic`, which does nothing
platform-specific. Both offer the same functions: dot_general, fuse_projections, fused_dense,
silu_gate, written_once, cache_write, trunk_unroll_auto, batch_slices_auto, real_vocab_only,
decode_compiler_options. Importing this package loads neither the CPU backend's MKL handler
(`backends.cpu.gemm`: when model.cpu_matmul takes it) nor its process defaults and re-exec
(`backends.cpu.runtime`: entry points, and CPU decoding's compile options).
"""

from __future__ import annotations

# JAX-free at import: the entry points import backends.cpu.runtime, whose re-exec must happen
# before anything imports jax, and importing it runs this file first.

__all__ = ["current", "one_cpu_device", "target_platform"]


def current():
  """The backend of the platform this trace compiles for (static: called while tracing)."""
  from mtp_jax.backends import generic, platform
  from mtp_jax.backends.cpu import ops as cpu_ops
  return cpu_ops if platform.target_platform() == "cpu" else generic


def target_platform() -> str:
  """`platform.target_platform`: 'cpu', 'gpu', 'tpu', what the code compiles for."""
  from mtp_jax.backends import platform
  return platform.target_platform()


def one_cpu_device() -> bool:
  """`platform.one_cpu_device`: whether the code compiles for a single CPU device."""
  from mtp_jax.backends import platform
  return platform.one_cpu_device()
