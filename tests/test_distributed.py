"""Starting a multi-process run (mtp_jax/distributed.py) without starting one: the GPUs each
Slurm layout hands `jax.distributed.initialize` (which is replaced here by a recorder), the
"off" mode, bounded barriers, and a lost peer told from a checkpoint failure (exit 6, not 4). A
real two-process run is in tests/integration/test_multihost.py."""

from __future__ import annotations

import types

import jax
import pytest

from mtp_jax import config as config_lib
from mtp_jax import distributed

# Every variable the launch reads; each test starts from none of them.
LAUNCH_VARS = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS",
    "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NUM_NODES", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
    "SLURM_GPUS_PER_TASK", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")


def _slurm_task(nodes: int, tasks_per_node: int, node: int, local: int, **extra) -> dict:
  """The variables srun gives task `local` on node `node` of a step over `nodes` nodes."""
  return dict(
      SLURM_JOB_ID="42", SLURM_STEP_NODELIST=f"gpu[001-{nodes:03d}]",
      SLURM_NTASKS=str(nodes * tasks_per_node), SLURM_STEP_NUM_TASKS=str(nodes * tasks_per_node),
      SLURM_PROCID=str(node * tasks_per_node + local), SLURM_LOCALID=str(local),
      SLURM_NODEID=str(node), SLURM_STEP_NUM_NODES=str(nodes),
      SLURM_STEP_TASKS_PER_NODE=f"{tasks_per_node}(x{nodes})", **extra)


# (name, the task's variables, the local device ids it must hand over)
LAYOUTS = [
    # srun --nodes=2 --ntasks-per-node=8 --gpus-per-task=1: Slurm binds one GPU per task, which
    # the task sees as device 0 (CUDA_VISIBLE_DEVICES=0 under cgroups, its own index without).
    ("task_per_gpu", _slurm_task(2, 8, 1, 5, SLURM_GPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES="0",
                                 SLURM_STEP_GPUS="5", SLURM_JOB_GPUS="0,1,2,3,4,5,6,7"), [0]),
    ("task_per_gpu_no_cgroup", _slurm_task(2, 8, 0, 3, SLURM_GPUS_PER_TASK="h100:1",
                                           CUDA_VISIBLE_DEVICES="3"), [0]),
    # srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=8: one task sees all the node's GPUs.
    ("task_per_node", _slurm_task(2, 1, 1, 0, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7",
                                  SLURM_STEP_GPUS="0,1,2,3,4,5,6,7"), list(range(8))),
    ("task_per_node_gpus_per_task", _slurm_task(2, 1, 0, 0, SLURM_GPUS_PER_TASK="8",
                                                CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"),
     list(range(8))),
    # --ntasks-per-node=8 --gpus-per-node=8 --gpu-bind=none: every task sees all 8 (JAX's case).
    ("tasks_share_the_gpus", _slurm_task(1, 8, 0, 6, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"),
     [6]),
    # Two tasks per node, four GPUs each, both seeing all eight.
    ("two_tasks_share_eight", _slurm_task(1, 2, 0, 1, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"),
     [4, 5, 6, 7]),
    # No CUDA_VISIBLE_DEVICES: Slurm's own indices are CUDA's ordinals.
    ("slurm_gpus_only", _slurm_task(1, 2, 0, 1, SLURM_STEP_GPUS="2,3"), [3]),
    # CPU runs under Slurm (tests/slurm) and GPU hints on a CPU run: JAX's own choice.
    ("cpu_slurm", _slurm_task(1, 2, 0, 1), None),
    ("cpu_platform", _slurm_task(1, 1, 0, 0, CUDA_VISIBLE_DEVICES="0,1", JAX_PLATFORMS="cpu"),
     None),
    ("no_gpu", _slurm_task(1, 1, 0, 0, CUDA_VISIBLE_DEVICES="NoDevFiles"), None),
    ("user_ids", _slurm_task(1, 1, 0, 0, CUDA_VISIBLE_DEVICES="0,1", JAX_LOCAL_DEVICE_IDS="1"),
     None),
    # mpirun -np 4 on a node whose four GPUs every rank sees.
    ("open_mpi", dict(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_SIZE="4",
                      OMPI_COMM_WORLD_LOCAL_RANK="2", CUDA_VISIBLE_DEVICES="0,1,2,3"), [2]),
]


@pytest.fixture
def launch(monkeypatch):
  """Sets a task's variables and records what `jax.distributed.initialize` is given."""
  calls = []
  for var in LAUNCH_VARS:
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setattr(distributed, "_on_cloud_tpu", lambda: False)
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)

  def run(env: dict):
    for k, v in env.items():
      monkeypatch.setenv(k, v)
    mesh = config_lib.base_config().mesh
    mesh.distributed, mesh.distributed_timeout_s = "on", 30
    assert distributed.maybe_initialize_distributed(mesh) is True
    assert len(calls) == 1
    return calls[0]
  return run


@pytest.mark.parametrize("name,env,want", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_each_slurm_layout_hands_jax_its_own_gpus(launch, name, env, want):
  kwargs = launch(env)
  assert kwargs["local_device_ids"] == want, name
  # The rest is left to JAX's Slurm / Open MPI detection, bounded by the timeout.
  assert (kwargs["coordinator_address"], kwargs["num_processes"], kwargs["process_id"]) == (
      None, None, None)
  assert kwargs["heartbeat_timeout_seconds"] == 30


def test_every_task_per_gpu_takes_device_0_and_shared_gpus_are_split(launch, monkeypatch):
  """All 16 tasks of a 2-node step with one GPU per task name device 0, the only one each sees;
  8 tasks that all see a node's 8 GPUs drive each of them once."""
  per_gpu = set()
  for node in range(2):
    for local in range(8):
      for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
      env = _slurm_task(2, 8, node, local, SLURM_GPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES="0")
      for k, v in env.items():
        monkeypatch.setenv(k, v)
      per_gpu.add(tuple(distributed.local_device_ids()))
  assert per_gpu == {(0,)}
  monkeypatch.delenv("SLURM_GPUS_PER_TASK")
  shared = []
  for local in range(8):
    for k, v in _slurm_task(1, 8, 0, local, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7").items():
      monkeypatch.setenv(k, v)
    shared += distributed.local_device_ids()
  assert sorted(shared) == list(range(8))


@pytest.mark.parametrize("flags,backends,started", [
    ("--xla_force_host_platform_device_count=4", False, True),
    ("--xla_force_host_platform_device_count=4", True, False),
    ("--xla_force_host_platform_device_count=1", False, False), ("", False, False)])
def test_one_process_on_several_cpu_devices_starts_a_cluster_of_itself(
    launch, monkeypatch, flags, backends, started):
  """With no launcher, "auto" on several CPU devices starts a one-process cluster on a free
  localhost port (its collectives then sum through gloo, in the order a run of several processes'
  do: tests/integration/test_multihost.py checks the bits); on one device, or once JAX has
  started its backends (too late for jax.distributed), it starts nothing."""
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(distributed, "_backends_started", lambda: backends)
  monkeypatch.setenv("XLA_FLAGS", flags)
  mesh = config_lib.base_config().mesh
  assert mesh.distributed == "auto"
  assert distributed.maybe_initialize_distributed(mesh) is started
  if started:
    (kw,) = calls
    host, port = kw["coordinator_address"].split(":")
    assert (host, kw["num_processes"], kw["process_id"]) == ("127.0.0.1", 1, 0)
    assert 0 < int(port) < 65536
  else:
    assert calls == []


def test_distributed_off_does_nothing(make_config):
  c = make_config()
  c.mesh.distributed = "off"
  c.mesh.coordinator_address, c.mesh.num_processes, c.mesh.process_id = "h:1", 2, 1
  assert distributed.maybe_initialize_distributed(c.mesh) is False
  assert not jax.distributed.is_initialized()


# Errors as JAX 0.10 and its gloo collectives raise them when a peer is gone or late (the lines
# of their C++ sources), and as the Checkpointer wraps them.
BARRIER = ("DEADLINE_EXCEEDED: Barrier timed out. Id: mtp_jax_train_checked. This usually happens "
           "because a task triggered the barrier too early or too slowly.")
HEARTBEAT = ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n"
             "/job:jax_worker/replica:0/task:1\nThe tasks have crashed.")
GLOO = ("INTERNAL: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:534] "
        "Connection closed by peer [127.0.0.1]:40021")


def _wrapped(message: str) -> RuntimeError:
  try:
    try:
      raise jax.errors.JaxRuntimeError(message)
    except RuntimeError as e:
      raise RuntimeError(f"Saving checkpoint step 3 to /w/checkpoints failed: {e}") from e
  except RuntimeError as e:
    return e


@pytest.mark.parametrize("error,line", [
    (distributed.PeerLost("config.mesh.distributed_timeout_s: process 1 of 2 waited 9 s"),
     "config.mesh.distributed_timeout_s: process 1 of 2 waited 9 s"),
    (jax.errors.JaxRuntimeError(BARRIER), BARRIER),
    (jax.errors.JaxRuntimeError(HEARTBEAT), HEARTBEAT.splitlines()[0]),
    (jax.errors.JaxRuntimeError(GLOO), GLOO),
    (_wrapped(GLOO), "Saving checkpoint step 3 to /w/checkpoints failed: " + GLOO),
    (RuntimeError("Saving checkpoint step 3 to /w failed: [Errno 28] No space left on device"),
     None),
    (RuntimeError("Restoring /w/checkpoints: every step failed to restore"), None),
])
def test_a_lost_peer_is_told_from_a_checkpoint_failure(error, line):
  assert distributed.lost_peer(error) == line


@pytest.mark.parametrize("error,status,line", [
    (jax.errors.JaxRuntimeError(BARRIER), distributed.EXIT_PEER_LOST,
     "error: lost a peer process: " + BARRIER),
    (_wrapped(HEARTBEAT), distributed.EXIT_PEER_LOST,
     "error: lost a peer process: Saving checkpoint step 3 to /w/checkpoints failed: "
     "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):"),
    (RuntimeError("Saving checkpoint step 3 to /w failed: [Errno 28] No space left on device"), 4,
     "error: Saving checkpoint step 3 to /w failed: [Errno 28] No space left on device"),
])
def test_train_exits_with_the_status_of_what_failed(monkeypatch, capsys, error, status, line):
  from mtp_jax import train

  def fail(config, workdir):
    raise error
  monkeypatch.setattr(train, "train", fail)
  assert train.cli_main(types.SimpleNamespace(config=None, workdir="w")) == status
  assert capsys.readouterr().err.splitlines() == [line]


def test_a_barrier_is_bounded_and_its_timeout_names_the_field(monkeypatch):
  import orbax.checkpoint as ocp
  calls = []

  def barrier(name, **kw):
    calls.append((name, kw))
    raise jax.errors.JaxRuntimeError(BARRIER)
  monkeypatch.setattr(ocp.multihost, "sync_global_processes", barrier)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  with pytest.raises(distributed.PeerLost) as e:
    distributed.sync_processes("mtp_jax_train_checked", 9, "opening the data")
  # The coordination service's barrier (a process set), which takes a timeout; orbax's default
  # (no process set) is a collective over the devices that has none.
  assert calls == [("mtp_jax_train_checked", {"timeout": 9, "processes": {0, 1}})]
  assert str(e.value) == (
      "config.mesh.distributed_timeout_s: barrier 'mtp_jax_train_checked' (9 s) failed in "
      "process 1 of 2: not every process arrived in time (opening the data): "
      "DEADLINE_EXCEEDED: Barrier timed out. Id: mtp_jax_train_checked. This usually happens "
      "because a task triggered the barrier too early or too slowly.")
  assert distributed.lost_peer(e.value) == str(e.value)


def test_one_process_has_no_barrier(monkeypatch):
  import orbax.checkpoint as ocp
  monkeypatch.setattr(ocp.multihost, "sync_global_processes", lambda *a, **k: 1 / 0)
  distributed.sync_processes("anything", 1)
