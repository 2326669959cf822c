"""The platform a trace compiles for, which picks the backend (`mtp_jax.backends.current`) and
the attention kernel (`attention.resolve`)."""

from __future__ import annotations

import jax


def target_platform() -> str:
  """'cpu', 'gpu', 'tpu': the platform of the mesh in context (its devices may be a topology's
  abstract ones, compiled for ahead of time), else the default backend's."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()


def one_cpu_device() -> bool:
  """Whether this trace compiles for a single CPU device: the mesh in context (its devices may
  be abstract), else the default backend's devices (static: called while tracing)."""
  mesh = jax.sharding.get_abstract_mesh()
  devices = jax.device_count() if mesh.empty else mesh.size
  return target_platform() == "cpu" and devices == 1
