"""Starting the processes of a multi-process run: `maybe_initialize_distributed` (config.mesh,
the JAX_* variables, or what a launcher such as Slurm, Open MPI or Cloud TPU says; on a GPU
launch the GPUs this process drives, `local_device_ids`), the launch check of the tools that run
in one process (`refuse_multiprocess`), the barrier between processes (`sync_processes`, bounded
by config.mesh.distributed_timeout_s), and a lost peer told from other failures (`lost_peer`,
exit status 6). Apart from sharding.py, which keeps the mesh and the logical-axis rules: nothing
below the entry points needs to know how processes were launched.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import sys
import threading

import jax
import ml_collections

from mtp_jax.config.base import DISTRIBUTED_MODES  # config.mesh.distributed

log = logging.getLogger(__name__)


class PeerLost(RuntimeError):
  """Another process of the run stopped answering: a barrier passed its timeout, or JAX's
  coordination service or a collective said a peer is gone. One line naming what failed."""


def sync_processes(name: str, timeout_s: int, others: str = "") -> None:
  """Waits until every process of the run reaches the barrier `name` (nothing in one process),
  at most `timeout_s` (config.mesh.distributed_timeout_s); past it PeerLost, naming the barrier
  and what the processes not there were doing (`others`). JAX's coordination service keeps the
  barrier, not a collective over the devices (orbax's default, which has no timeout)."""
  if jax.process_count() == 1:
    return
  import orbax.checkpoint as ocp
  try:
    ocp.multihost.sync_global_processes(name, timeout=int(timeout_s),
                                        processes=set(range(jax.process_count())))
  except RuntimeError as e:
    raise PeerLost(
        f"config.mesh.distributed_timeout_s: barrier {name!r} ({int(timeout_s)} s) failed in "
        f"process {jax.process_index()} of {jax.process_count()}: not every process arrived in "
        f"time{' (' + others + ')' if others else ''}: "
        f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e


# What JAX's coordination service (heartbeats, barriers, preemption sync) and its CPU collectives
# (gloo) write in the errors they raise when a peer process is gone or late.
_PEER_MARKERS = ("heartbeat", "barrier timed out", "coordination service", "/job:jax_worker",
                 "gloo", "connection closed by peer", "connection reset by peer",
                 "preemption sync")


def lost_peer(error: BaseException) -> str | None:
  """One line saying how a peer process was lost, if `error` or an error it was raised from
  (its causes and contexts) says so; None otherwise (a checkpoint's own failure, say)."""
  stack, seen = [error], set()
  while stack:
    e = stack.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if isinstance(e, PeerLost):
      return lines[0] if lines else "a peer process was lost"
    hit = next((line for line in lines if any(m in line.lower() for m in _PEER_MARKERS)), None)
    if hit:
      return hit
    stack += [e.__context__, e.__cause__]
  return None


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


# Where a GPU launch says which GPUs this process sees, most direct first: CUDA's own list (Slurm
# sets it for a job or step with GPUs), else Slurm's GPU indices on the node (global ordinals, as
# CUDA numbers them when it is not set).
GPU_LIST_VARS = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")


def _visible_gpus() -> list[int] | None:
  """The CUDA ordinals this process can use, before any backend starts; None without a GPU
  hint. CUDA renumbers the GPUs of CUDA_VISIBLE_DEVICES from 0 (entries may be indices or
  UUIDs); Slurm's lists name the node's own indices."""
  for var in GPU_LIST_VARS:
    value = os.environ.get(var, "").strip()
    if not value:
      continue
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if var == "CUDA_VISIBLE_DEVICES":
      if value in ("NoDevFiles", "-1") or not entries:  # Slurm's and CUDA's "no GPU"
        return None
      return list(range(len(entries)))
    if all(e.isdigit() for e in entries):
      return [int(e) for e in entries]
  return None


def _count(var: str) -> int | None:
  """A launcher's variable as a count or index; None where it is unset or not one."""
  value = os.environ.get(var, "").strip()
  return int(value) if value.isdigit() else None


def _tasks_on_node() -> int | None:
  """How many processes of this launch run on this node: SLURM_STEP_TASKS_PER_NODE ("8(x2),4",
  one entry per node, in SLURM_NODEID's order), else SLURM_NTASKS_PER_NODE, else Open MPI's."""
  spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").strip()
  node = _count("SLURM_NODEID") or 0
  counts = []
  for part in filter(None, spec.split(",")):
    n, _, rep = part.partition("(x")
    if not n.isdigit():
      counts = []
      break
    counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
  if node < len(counts):
    return counts[node]
  return _count("SLURM_NTASKS_PER_NODE") or _count("OMPI_COMM_WORLD_LOCAL_SIZE")


def local_device_ids() -> list[int] | None:
  """The GPUs this process drives, for `jax.distributed.initialize(local_device_ids=...)`; None
  where JAX's own choice is right (no GPU hint, a CPU or TPU run).

  JAX's Slurm detection gives every task [SLURM_LOCALID]: right only when each of N tasks on a
  node sees all N GPUs. With `--gpus-per-task=1` Slurm binds one GPU to each task, which sees it
  as device 0 (SLURM_LOCALID 3 is then an invalid ordinal); with one task per node the task
  sees all the node's GPUs and must drive them all, not GPU 0 alone. So: a task whose GPUs are
  its own (it sees no more than its share: SLURM_GPUS_PER_TASK, else the visible GPUs over the
  tasks on the node) takes all it sees; tasks that see the same GPUs take their share each, by
  SLURM_LOCALID or Open MPI's local rank (JAX's case). JAX_LOCAL_DEVICE_IDS, when set, wins."""
  if os.environ.get("JAX_LOCAL_DEVICE_IDS", "").strip():  # the user's own: JAX reads it
    return None
  platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
  if platforms and not {"cuda", "gpu", "rocm"} & set(platforms.split(",")):
    return None
  visible = _visible_gpus()
  if not visible or _on_cloud_tpu():
    return None
  tasks = _tasks_on_node() or 1
  per_task = os.environ.get("SLURM_GPUS_PER_TASK", "").strip().rpartition(":")[2]  # [type:]n
  share = (int(per_task) if per_task.isdigit() and int(per_task) > 0
           else max(len(visible) // tasks, 1))
  if len(visible) <= share:
    return visible
  local = next((n for n in map(_count, ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"))
                if n is not None), 0)
  start = local * share % len(visible)
  return visible[start:start + share]


def maybe_initialize_distributed(mesh: ml_collections.ConfigDict) -> bool:
  """Starts `jax.distributed` for a multi-process run as config.mesh asks; returns whether it
  did. Call it before anything touches a device (the mesh, the data pipeline).

  mesh.distributed "off": never. "on": always. "auto": when a launch is evident: a coordinator
  address (config.mesh.coordinator_address or JAX_COORDINATOR_ADDRESS), more than one process
  announced by Slurm (srun -n: SLURM_STEP_NUM_TASKS), Open MPI or JAX_NUM_PROCESSES, or TPU
  chips on the PCI bus; otherwise a plain single process (a one-host TPU VM gets a one-process
  cluster, which changes nothing), or on several CPU devices a cluster of this process alone, so
  that its collectives sum in the order a run of several processes' do (`_one_process_cluster`).
  The coordinator, process count and id come from config.mesh or the JAX_* variables
  (`cluster_from`), else JAX finds them (Slurm, Open MPI, Cloud TPU).

  `mesh.distributed_timeout_s` bounds the waits: for every process to arrive at start-up
  (past it: one line saying so and exit status 5, not a hang), for a peer's heartbeat during
  the run (past it JAX ends every surviving process with a line naming the lost task), and, given
  to them by the caller, the barriers (`sync_processes`, the Checkpointer's).
  """
  if mesh.distributed not in DISTRIBUTED_MODES:
    raise ValueError(f"config.mesh.distributed: got {mesh.distributed!r}, allowed: "
                     + ", ".join(map(repr, DISTRIBUTED_MODES)))
  if mesh.distributed == "off" or jax.distributed.is_initialized():
    return False
  cluster = cluster_from(mesh)
  if mesh.distributed == "auto" and not (cluster.coordinator_address or
                                         launched_processes() > 1 or _on_cloud_tpu()):
    if cpu_device_count() < 2 or _backends_started():
      return False
    cluster = _one_process_cluster()
  timeout = int(mesh.distributed_timeout_s)
  # JAX's own deadline ends the process with a C++ stack trace; this one says what happened
  # first, in one line, and leaves JAX's a few seconds later as a fallback.
  watchdog = threading.Timer(timeout, _never_arrived, args=(cluster, timeout))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator_address, num_processes=cluster.num_processes,
        process_id=cluster.process_id, local_device_ids=local_device_ids(),
        initialization_timeout=timeout + 10, heartbeat_timeout_seconds=timeout)
  finally:
    watchdog.cancel()
  log.info("jax.distributed: process %d of %d, %d local / %d global devices",
           jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count())
  return True


# Exit statuses of a multi-process run's failures (train.py's others: 2 bad input, 3 non-finite,
# 4 checkpoint failure): 5, not every process arrived at start-up; 6, a peer was lost during the
# run (PeerLost, or an error that `lost_peer` recognises).
EXIT_PEERS_MISSING = 5
EXIT_PEER_LOST = 6


def cpu_device_count() -> int:
  """The CPU devices this process will have, read before JAX starts: jax_num_cpu_devices, else
  XLA_FLAGS' --xla_force_host_platform_device_count, else 1."""
  n = int(jax.config.jax_num_cpu_devices)
  if n > 0:
    return n
  flag = "--xla_force_host_platform_device_count="
  counts = [f[len(flag):] for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith(flag)]
  return int(counts[-1]) if counts and counts[-1].isdigit() else 1


def _backends_started() -> bool:
  """Whether JAX has started a backend in this process (jax.distributed must come before; a
  notebook that ran JAX before calling train keeps XLA's in-process collectives)."""
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # not in this JAX: do not risk it
    return True


def _one_process_cluster() -> Cluster:
  """A cluster of this process alone, its coordinator on a free localhost port. On several CPU
  devices a run starts one, so that its collectives go through gloo, as a run of P processes'
  do: XLA's in-process collectives sum a float over 4 devices as ((x0 + x1) + x2) + x3, gloo in
  an order of its own (a ring: each chunk from another device), and a run's bits would then
  depend on how many processes hold its devices. Through gloo they do not (tests/test_multihost
  .py; experiments/reduction_order.py shows both orders)."""
  return Cluster(free_local_address(), 1, 0)


def free_local_address() -> str:
  """"127.0.0.1:PORT", a port free now: a coordinator for processes on this machine alone."""
  import socket
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{sock.getsockname()[1]}"


def _never_arrived(cluster: Cluster, timeout: int) -> None:
  who = (f"process {cluster.process_id}" if cluster.process_id is not None else "this process")
  of = f" of {cluster.num_processes}" if cluster.num_processes else ""
  at = cluster.coordinator_address or "the coordinator JAX found"
  print(f"error: config.mesh.distributed_timeout_s: {who}{of} waited {timeout} s at {at} and "
        "not every process arrived; start all of them with the same coordinator address and "
        "process count, each with its own process id", file=sys.stderr, flush=True)
  os._exit(EXIT_PEERS_MISSING)
