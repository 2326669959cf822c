"""Device mesh and shardings. The only module that knows mesh axis names: the model only speaks
logical axis names, and `config.mesh.rules` maps them to ("data", "fsdp", "tensor")."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")


def mesh_shape(config: ml_collections.ConfigDict, n_devices: int) -> tuple[int, ...]:
  """(data, fsdp, tensor) with one -1 filled in; ValueError if it does not match the devices."""
  sizes = [getattr(config.mesh, a) for a in AXES]
  if sizes.count(-1) > 1:
    raise ValueError("config.mesh: at most one of data, fsdp, tensor may be -1")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if n_devices % known:
      raise ValueError(f"config.mesh: {dict(zip(AXES, sizes))} cannot fill {n_devices} devices "
                       f"({n_devices} is not a multiple of {known})")
    sizes[sizes.index(-1)] = n_devices // known
  if math.prod(sizes) != n_devices:
    raise ValueError(f"config.mesh: data*fsdp*tensor = {math.prod(sizes)} but there are "
                     f"{n_devices} devices; set the sizes to multiply to {n_devices} or use -1")
  return tuple(sizes)


def make_mesh(config: ml_collections.ConfigDict, devices=None) -> Mesh:
  """A mesh with Auto axes (GSPMD): JAX 0.10's make_mesh defaults to Explicit axes, which
  reject some sharded matmuls."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(config, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * 3)


def rules(config: ml_collections.ConfigDict):
  return tuple((name, tuple(ax) if isinstance(ax, list) else ax) for name, ax in config.mesh.rules)


def logical_shardings(boxed_tree, mesh: Mesh, config: ml_collections.ConfigDict):
  """NamedShardings for a pytree whose leaves carry logical partitioning boxes (e.g. the
  abstract train state); unboxed leaves are replicated."""
  specs = nn.get_partition_spec(boxed_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules(config))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(("data", "fsdp")))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
