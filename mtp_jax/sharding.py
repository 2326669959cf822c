"""Device mesh and shardings. The only module that knows mesh axis names: the model only speaks
logical axis names, and `config.mesh.rules` maps them to ("data", "fsdp", "tensor").

Everything here is JAX's own SPMD partitioning (GSPMD through `jax.jit` in/out shardings): params
and optimizer state are sharded FSDP-style over `fsdp` (the "embed" axis) and tensor-parallel
over `tensor` (vocab, MLP and attention heads); the batch over (`data`, `fsdp`); the residual
stream at block boundaries by `constrain`, active while a step is traced inside
`activation_rules`. The stacked head axis ("mtp_heads") is replicated by default; a rule such as
("mtp_heads", "tensor") placed before the others shards it (flax takes rules in order), and the
loss scan over heads works either way. tests/test_sharding.py checks all of it against one
device on 8 simulated CPU devices.

Multi-host: start the processes first (distributed.py, `maybe_initialize_distributed`), build
the mesh over `jax.devices()` (all hosts' devices), and give `shard_batch` the global batch,
which every process makes alike (data/pipeline.py): each hands its own devices their rows.
tests/integration/test_multihost.py runs two real processes.
"""

from __future__ import annotations

import contextlib
import contextvars
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
  """The logical-axis rules as flax wants them (tuples, not the lists a JSON config gives)."""
  return tuple((name, tuple(ax) if isinstance(ax, list) else ax) for name, ax in config.mesh.rules)


def _path_name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def spec_axes(entry) -> tuple:
  """A PartitionSpec entry as a tuple of mesh axis names: () for None, (name,) for one."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _check_divisible(path, shape, logical, spec, mesh: Mesh) -> None:
  """device_put and jit refuse uneven shards with an error that names no parameter; say which
  parameter, which logical axis, and what to change, before anything is allocated."""
  for dim, (size, names, axes) in enumerate(zip(shape, logical, spec)):
    axes = spec_axes(axes)
    n = math.prod(mesh.shape[a] for a in axes)
    if size % n:
      fix = ("raise config.model.vocab_multiple (the vocabulary is padded to a multiple of it)"
             if names == "vocab" else "change that size in config.model")
      raise ValueError(
          f"config.mesh.rules: {_path_name(path)} dim {dim} ({names!r}, size {size}) "
          f"does not split over mesh axes {axes} ({n} devices); {fix} or map {names!r} to None")


def logical_shardings(boxed_tree, mesh: Mesh, config: ml_collections.ConfigDict):
  """NamedShardings for a pytree whose leaves carry logical partitioning boxes (e.g. the
  abstract train state); unboxed leaves are replicated. ValueError if a sharded dimension does
  not divide by its mesh axes."""
  logical = nn.get_partition_spec(boxed_tree)
  shardings = nn.logical_to_mesh_sharding(logical, mesh, rules(config))
  is_spec = lambda x: isinstance(x, P)
  for (path, names), sh, leaf in zip(
      jax.tree_util.tree_flatten_with_path(logical, is_leaf=is_spec)[0],
      jax.tree.leaves(shardings), jax.tree.leaves(nn.unbox(boxed_tree))):
    shape = np.shape(leaf)
    _check_divisible(path, shape, tuple(names) + (None,) * (len(shape) - len(names)),
                     tuple(sh.spec) + (None,) * (len(shape) - len(sh.spec)), mesh)
  return shardings


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows over (data, fsdp): FSDP devices each take their own rows, as data devices do."""
  return NamedSharding(mesh, P(("data", "fsdp")))


def check_batch(config: ml_collections.ConfigDict, mesh: Mesh) -> None:
  """Every micro-batch must split evenly over the devices that share the batch axis."""
  n = mesh.shape["data"] * mesh.shape["fsdp"]
  micro = config.train.batch_size // config.train.grad_accum
  if micro % n:
    raise ValueError(f"config.train.batch_size: batch_size / grad_accum = {micro} rows must "
                     f"divide over mesh data*fsdp = {n} devices")


def shard_batch(batch, sharding: NamedSharding):
  """The global batch as arrays sharded by `sharding`. Every process holds the same global host
  batch (the data pipeline makes it from the step alone) and hands its own devices their rows
  of it (`local_rows`); one process simply puts it on its devices."""
  if jax.process_count() == 1:
    return jax.device_put(batch, sharding)
  return jax.tree.map(
      lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), batch)


def local_rows(n_rows: int, sharding: NamedSharding) -> list[tuple[int, int]]:
  """[(start, stop), ...] of the batch rows that this process's devices hold under `sharding`,
  merged where they touch: what `shard_batch` reads from the global batch here."""
  spans = sorted({index[0].indices(n_rows)[:2] for index in
                  sharding.addressable_devices_indices_map((n_rows,)).values()})
  merged: list[tuple[int, int]] = []
  for start, stop in spans:
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(stop, merged[-1][1]))
    else:
      merged.append((start, stop))
  return merged


# (mesh, rules) while tracing inside `activation_rules`; None elsewhere.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("mtp_jax_activation_rules", default=None)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, config: ml_collections.ConfigDict):
  """While a jitted step is traced inside this context, `constrain` calls in the model pin
  activations to the mesh by the config's rules; elsewhere they are no-ops, so one-device code
  and tests need nothing. Enter it around the first call (the trace) of the jitted step.

  `jax.set_mesh` is entered too because jax keys its trace caches on the mesh context: without
  it a function traced once outside would be reused inside, constraints silently missing (seen).
  flax's global `nn.logical_axis_rules` is deliberately not set: with it, flax also constrains
  every param's init function, and DenseGeneral's flat-then-reshaped kernel init fails the rank
  check inside apply's shape check (flax 0.12.8)."""
  token = _ACTIVE.set((mesh, rules(config)))
  try:
    with jax.set_mesh(mesh):  # part of jax's trace-cache key, unlike our context variable
      yield
  finally:
    _ACTIVE.reset(token)


def constrain(x, logical_axes: tuple):
  """`nn.with_logical_constraint` on the mesh and rules of the enclosing `activation_rules`."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, logical_rules = active
  return nn.with_logical_constraint(x, logical_axes, rules=logical_rules, mesh=mesh)


def active_spec(logical_axes: tuple):
  """(mesh, PartitionSpec) of `logical_axes` by the rules of the enclosing `activation_rules`;
  None outside it. For code that must shard_map itself (a Pallas kernel, which GSPMD cannot
  partition)."""
  active = _ACTIVE.get()
  if active is None:
    return None
  mesh, logical_rules = active
  return mesh, nn.logical_to_mesh_axes(logical_axes, logical_rules)
