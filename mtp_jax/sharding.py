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

Multi-host: call `maybe_initialize_distributed` first thing (config.mesh, or the JAX_*
variables, or the launcher), build the mesh over `jax.devices()` (all hosts' devices), and give
`shard_batch` the global batch, which every process makes alike (data/pipeline.py): each hands
its own devices their rows. tests/integration/test_multihost.py runs two real processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import glob
import logging
import math
import os
import sys
import threading

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mtp_jax.config.base import DISTRIBUTED_MODES  # config.mesh.distributed

log = logging.getLogger(__name__)

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


def _check_divisible(path, shape, logical, spec, mesh: Mesh) -> None:
  """device_put and jit refuse uneven shards with an error that names no parameter; say which
  parameter, which logical axis, and what to change, before anything is allocated."""
  for dim, (size, names, axes) in enumerate(zip(shape, logical, spec)):
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
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


def sync_processes(name: str) -> None:
  """Waits until every process of the run reaches the barrier `name` (nothing in one process)."""
  if jax.process_count() > 1:
    import orbax.checkpoint as ocp
    ocp.multihost.sync_global_processes(name)


def _on_cloud_tpu() -> bool:
  """TPU chips on this VM's PCI bus (what JAX itself looks at), without starting a backend:
  jax.distributed must come first."""
  try:
    from jax._src import hardware_utils
    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
  except Exception:  # (a private module: fall back to the nodes)
    return bool(glob.glob("/dev/accel*") or os.environ.get("TPU_WORKER_HOSTNAMES"))


# Where a launcher says how many processes it started (JAX's own variable, Slurm's srun, Open
# MPI's mpirun): a process count > 1 in any of them is a multi-process launch. Slurm's is the job
# step's (srun -n 2), not SLURM_NTASKS: a batch script runs once in an allocation of many tasks.
LAUNCHER_COUNT_VARS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")  # JAX finds the rest
LAUNCH_COUNT_VARS = ("JAX_NUM_PROCESSES",) + LAUNCHER_COUNT_VARS


def launched_processes(variables: tuple[str, ...] = LAUNCH_COUNT_VARS) -> int:
  """How many processes the launcher of this one started (1 when none of `variables` says):
  what a tool that runs in one process only (generate, evaluate) checks, without starting
  jax.distributed."""
  for var in variables:
    try:
      n = int(os.environ.get(var, "") or 1)
    except ValueError:
      continue
    if n > 1:
      return n
  return 1


def refuse_multiprocess(tool: str) -> None:
  """ValueError for a tool that runs in one process when a launcher started several: each
  process would run the whole job and write the same files."""
  n = launched_processes()
  if n > 1:
    raise ValueError(f"{tool} runs in one process, but its launcher started {n} (srun -n, "
                     "mpirun or JAX_NUM_PROCESSES); run it as a single process (srun -n 1) on one "
                     "host, which decodes or evaluates over that host's devices")


@dataclasses.dataclass(frozen=True)
class Cluster:
  """What `jax.distributed.initialize` is given: None lets JAX find it (Slurm, Open MPI, Cloud
  TPU)."""
  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None


def _env_int(var: str) -> int | None:
  value = os.environ.get(var, "").strip()
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{var}: must be an integer, got {value!r}") from None


def cluster_from(mesh: ml_collections.ConfigDict) -> Cluster:
  """The coordinator, process count and process id from config.mesh, else from
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (JAX 0.10 itself reads only the
  address); ValueError naming the field or variable for a bad or missing value."""
  address = mesh.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip()
  where = "config.mesh.coordinator_address" if mesh.coordinator_address else \
      "JAX_COORDINATOR_ADDRESS"
  n, n_name = ((mesh.num_processes, "config.mesh.num_processes") if mesh.num_processes
               else (_env_int("JAX_NUM_PROCESSES"), "JAX_NUM_PROCESSES"))
  pid, pid_name = ((mesh.process_id, "config.mesh.process_id") if mesh.process_id >= 0
                   else (_env_int("JAX_PROCESS_ID"), "JAX_PROCESS_ID"))
  if address:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(f"{where}: must be HOST:PORT (port 1-65535), got {address!r}")
  if n is not None and n < 1:
    raise ValueError(f"{n_name}: must be >= 1, got {n}")
  if pid is not None and n is not None and not 0 <= pid < n:
    raise ValueError(f"{pid_name}: must be in [0, {n}) ({n_name} = {n}), got {pid}")
  detected = launched_processes(LAUNCHER_COUNT_VARS) > 1  # JAX reads the rest from Slurm / MPI
  if address and not detected and (n is None or pid is None) and not _on_cloud_tpu():
    missing = " and ".join(name for v, name in ((n, "JAX_NUM_PROCESSES / config.mesh."
                                                    "num_processes"),
                                                (pid, "JAX_PROCESS_ID / config.mesh.process_id"))
                           if v is None)
    raise ValueError(f"{missing}: required with a coordinator address ({where} = {address!r}) "
                     "when no launcher (Slurm, Open MPI, Cloud TPU) gives it")
  if (n is not None or pid is not None) and not address and not detected:
    raise ValueError(f"{where}: required with {n_name if n is not None else pid_name} "
                     "(HOST:PORT of process 0, the same for every process)")
  return Cluster(address or None, n, pid)


def maybe_initialize_distributed(mesh: ml_collections.ConfigDict) -> bool:
  """Starts `jax.distributed` for a multi-process run as config.mesh asks; returns whether it
  did. Call it before anything touches a device (the mesh, the data pipeline).

  mesh.distributed "off": never. "on": always. "auto": when a launch is evident: a coordinator
  address (config.mesh.coordinator_address or JAX_COORDINATOR_ADDRESS), more than one process
  announced by Slurm (srun -n: SLURM_STEP_NUM_TASKS), Open MPI or JAX_NUM_PROCESSES, or TPU
  chips on the PCI bus; otherwise a plain single process (a one-host TPU VM gets a one-process
  cluster, which changes nothing). The coordinator, process count and id come from config.mesh
  or the JAX_* variables (`cluster_from`), else JAX finds them (Slurm, Open MPI, Cloud TPU).

  `mesh.distributed_timeout_s` bounds both waits: for every process to arrive at start-up
  (past it: one line saying so and exit status 5, not a hang), and for a
  peer's heartbeat during the run (past it JAX ends every surviving process with a line naming
  the lost task).
  """
  if mesh.distributed not in DISTRIBUTED_MODES:
    raise ValueError(f"config.mesh.distributed: got {mesh.distributed!r}, allowed: "
                     + ", ".join(map(repr, DISTRIBUTED_MODES)))
  if mesh.distributed == "off" or jax.distributed.is_initialized():
    return False
  cluster = cluster_from(mesh)
  if mesh.distributed == "auto" and not (cluster.coordinator_address or
                                         launched_processes() > 1 or _on_cloud_tpu()):
    return False
  timeout = int(mesh.distributed_timeout_s)
  # JAX's own deadline ends the process with a C++ stack trace; this one says what happened
  # first, in one line, and leaves JAX's a few seconds later as a fallback.
  watchdog = threading.Timer(timeout, _never_arrived, args=(cluster, timeout))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator_address, num_processes=cluster.num_processes,
        process_id=cluster.process_id, initialization_timeout=timeout + 10,
        heartbeat_timeout_seconds=timeout)
  finally:
    watchdog.cancel()
  log.info("jax.distributed: process %d of %d, %d local / %d global devices",
           jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count())
  return True


# Exit status of a process whose peers did not all arrive in time (train.py's other statuses:
# 2 bad input, 3 non-finite, 4 checkpoint failure).
EXIT_PEERS_MISSING = 5


def _never_arrived(cluster: Cluster, timeout: int) -> None:
  who = (f"process {cluster.process_id}" if cluster.process_id is not None else "this process")
  of = f" of {cluster.num_processes}" if cluster.num_processes else ""
  at = cluster.coordinator_address or "the coordinator JAX found"
  print(f"error: config.mesh.distributed_timeout_s: {who}{of} waited {timeout} s at {at} and "
        "not every process arrived; start all of them with the same coordinator address and "
        "process count, each with its own process id", file=sys.stderr, flush=True)
  os._exit(EXIT_PEERS_MISSING)
