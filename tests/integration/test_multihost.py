"""Two real processes through jax.distributed on this machine (localhost coordinator, gloo
collectives, 2 CPU devices each), launched as a launcher does: JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID. Every run trains configs/tiny.py on the mesh data=2 x
fsdp=2, and is compared with one process holding 4 CPU devices on the same mesh: the same
batches, losses and params; one set of run files; resume within and across process counts; a
peer killed with SIGKILL; a peer that never arrives; the tools that run in one process only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import conftest
from conftest import copy_code_corpus
import test_golden

from mtp_jax import config as config_lib
from mtp_jax import distributed
from mtp_jax import steps as steps_lib
from mtp_jax import workdir as workdir_lib
from mtp_jax.data import corpora, pipeline, prepare

STEPS = 6
TIMEOUT_S = 30  # mesh.distributed_timeout_s of the 2-process runs: heartbeats and barriers


def train_cmd(corpus, workdir, *overrides):
  return conftest.train_cmd(
      corpus, workdir, "--config.mesh.data=2", "--config.mesh.fsdp=2",
      f"--config.train.steps={STEPS}", "--config.train.checkpoint_every=3",
      "--config.train.eval_every=3", f"--config.mesh.distributed_timeout_s={TIMEOUT_S}",
      *overrides)


def env_for(corpus, devices: int, **extra) -> dict:
  """The environment of a run's processes: no launcher variables but `extra`, and XLA's own
  CPU pipeline, not conftest's fast-compile flags (test_golden pins the former's hashes)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
  env.pop("XLA_FLAGS", None)
  return dict(env, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=corpus["cache"],
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **extra)


def start(corpus, workdir, n: int, *overrides):
  """n processes of one run (n = 1: one process with 4 devices), outputs piped."""
  if n == 1:
    return [subprocess.Popen(train_cmd(corpus, workdir, *overrides), env=env_for(corpus, 4),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
  address = distributed.free_local_address()
  return [subprocess.Popen(
      train_cmd(corpus, workdir, *overrides), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=env_for(corpus, 4 // n, JAX_COORDINATOR_ADDRESS=address,
                             JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i)))
          for i in range(n)]


def finish(procs, timeout=300):
  """[(returncode, stdout, stderr)] of every process; AssertionError if one failed."""
  out = []
  for p in procs:
    try:
      stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    out.append((p.returncode, stdout, stderr))
  for i, (rc, stdout, stderr) in enumerate(out):
    if rc != 0:
      raise AssertionError(f"process {i} of {len(out)} exited {rc}:\n{stdout[-2000:]}\n"
                           f"{stderr[-3000:]}")
  return out


def train(corpus, workdir, n: int, *overrides):
  return finish(start(corpus, workdir, n, *overrides))


def summary(workdir):
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def batch_hashes(workdir):
  with open(workdir_lib.batches_path(workdir)) as f:
    return [line.split() for line in f]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return copy_code_corpus(tmp_path_factory.mktemp("multihost_corpus"))


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
  """The straight runs (one process x 4 devices, two processes x 2 devices), and a 2-process run
  stopped at step 3 with copies for the kill and SIGTERM tests."""
  tmp = tmp_path_factory.mktemp("multihost")
  one, two, stopped = tmp / "one", tmp / "two", tmp / "stop_two"
  out_one = train(corpus, one, 1)
  out_two = train(corpus, two, 2)
  train(corpus, stopped, 2, "--config.train.stop_at=3")
  return {"one": one, "two": two, "out_one": out_one, "out_two": out_two, "tmp": tmp,
          "stopped_two": stopped, "killed": _copy(stopped, tmp / "killed"),
          "sigterm": _copy(stopped, tmp / "sigterm")}


# Heavy tier: the ~90 s fixture; srun -n 2 (tests/slurm) repeats it, test_distributed the launch
@pytest.mark.heavy
def test_two_processes_train_as_one_with_four_devices(runs):
  one, two = runs["one"], runs["two"]
  assert "in 2 processes" in runs["out_two"][0][1]
  assert batch_hashes(one) == batch_hashes(two)  # the global batch of every step
  a, b = losses(one), losses(two)
  assert sorted(a) == sorted(b) and len(a) == STEPS
  for step in a:
    assert b[step] == pytest.approx(a[step], rel=1e-6)
  # The same program over the same devices: XLA reduces in the same order, bit for bit.
  assert summary(two)["params_sha256"] == summary(one)["params_sha256"]
  test_golden.check("two_processes", summary(two)["params_sha256"])  # and pinned
  assert summary(two)["step"] == STEPS
  assert (summary(two)["processes"], summary(one)["processes"]) == (2, 1)
  assert summary(two)["devices"] == summary(one)["devices"] == 4


@pytest.mark.heavy  # Heavy tier: the ~90 s fixture
def test_process_zero_alone_writes_the_run_files(runs):
  two = runs["two"]
  names = sorted(os.listdir(two))
  assert [n for n in names if n.startswith("events.out.tfevents")].__len__() == 1
  for name in ("summary.json", "metrics.jsonl", "config.json", "batches.log"):
    assert names.count(name) == 1
  assert not [n for n in names if n.endswith(".tmp")]
  (rc0, out0, err0), (rc1, out1, _) = runs["out_two"]
  assert f"step {STEPS}/{STEPS}" in out0 and "params_sha256" in out0
  # A corpus packed while training: every process packs the whole batch, and says so once.
  assert len([line for line in err0.splitlines() if line.startswith(
      "warning: every process packs the whole global batch")]) == 1, err0[-2000:]
  assert summary(two)["tokens_read_per_process"] == summary(runs["one"])[
      "tokens_read_per_process"] * 2
  # Process 1 prints nothing of its own (gloo's C++ prints its connections in every process).
  # Gloo's own connection lines (two threads: they can interleave mid-line) are not ours.
  gloo = lambda line: "[Gloo]" in line or "peer ranks" in line or not line.strip()
  assert [line for line in out1.splitlines() if not gloo(line)] == [], out1


# Heavy tier: the ~90 s fixture; each process's rows of the batch are test_rows.py's
@pytest.mark.heavy
def test_each_process_feeds_its_own_rows_of_the_global_batch(runs):
  """Per step, the rows each process handed its devices (its batches.process-* log) are a
  disjoint part of the global batch that one process makes from the saved config, and together
  all of it."""
  two = runs["two"]
  config = workdir_lib.read_config(str(two))
  it = pipeline.make_iterator(config, "train")
  expected = [next(it) for _ in range(STEPS)]
  assert [h for _, h in batch_hashes(two)] == [steps_lib.batches_sha256([b]) for b in expected]
  covered = []
  for p in range(2):
    with open(workdir_lib.process_batches_path(str(two), p, 2)) as f:
      lines = [line.split() for line in f]
    assert [int(line[0]) for line in lines] == list(range(STEPS))
    spans = [tuple(map(int, s.split(":"))) for s in lines[0][3].split(",")]
    covered += [r for a, b in spans for r in range(a, b)]
    for (step, digest, _, _), batch in zip(lines, expected):
      mine = {k: np.concatenate([v[a:b] for a, b in spans]) for k, v in batch.items()}
      assert digest == steps_lib.batches_sha256([mine]), (p, step)
  assert sorted(covered) == list(range(config.train.batch_size))  # disjoint, and the whole


# Heavy tier: four runs (~2 min); rows read per process, P = 1, 2, 4, are test_rows.py's
@pytest.mark.heavy
def test_on_token_shards_each_process_reads_only_its_rows(corpus, tmp_path):
  """The code corpus prepared as token shards: each of P = 2 and 4 processes reads 1/P of the
  tokens that one process reads, its rows are its devices' rows of the global batch one process
  makes, and the params equal one process's bit for bit, and those of 2 processes that each pack
  the whole batch (the same shards without their lengths files)."""
  prepare.prepare(f"folder:{corpus['folder']}", "byte", str(tmp_path / "shards"), shards=2,
                  workers=0)
  old = _copy(tmp_path / "shards", tmp_path / "old_shards")
  for f in old.glob("*" + corpora.LENGTHS_SUFFIX):
    f.unlink()
  shards = lambda d: (f"--config.data.files={d}/tokens-*.array_record",
                      "--config.data.corpus=array_record")
  one, two, four = tmp_path / "one", tmp_path / "two", tmp_path / "four"
  packs = tmp_path / "two_packing"
  train(corpus, one, 1, *shards(tmp_path / "shards"))
  (_, _, err0), _ = train(corpus, two, 2, *shards(tmp_path / "shards"))
  assert "warning:" not in err0
  train(corpus, four, 4, *shards(tmp_path / "shards"))
  (_, _, err0), _ = train(corpus, packs, 2, *shards(old))
  assert "warning: every process packs the whole global batch" in err0
  a, b, d, c = summary(one), summary(two), summary(four), summary(packs)
  assert a["reads_own_rows"] and b["reads_own_rows"] and d["reads_own_rows"]
  assert not c["reads_own_rows"]
  for s, n in ((a, 1), (b, 2), (d, 4)):
    assert len(s["tokens_read_per_process"]) == n
    for read in s["tokens_read_per_process"]:
      assert read == pytest.approx(a["tokens_read_per_process"][0] / n, rel=0.1)
  assert c["tokens_read_per_process"] == a["tokens_read_per_process"] * 2
  # Reading its rows changes nothing in what a process trains on, bit for bit; one process on
  # 4 CPU devices sums through gloo as P processes do (distributed._one_process_cluster).
  assert a["params_sha256"] == b["params_sha256"] == d["params_sha256"] == c["params_sha256"]
  assert losses(one) == losses(two) == losses(four) == losses(packs)
  config = workdir_lib.read_config(str(two))
  it = pipeline.make_iterator(config, "train")
  expected = [next(it) for _ in range(STEPS)]
  assert [h for _, h in batch_hashes(one)] == [steps_lib.batches_sha256([e]) for e in expected]
  assert batch_hashes(packs) == batch_hashes(one)
  for p in range(2):
    with open(workdir_lib.process_batches_path(str(two), p, 2)) as f:
      lines = [line.split() for line in f]
    spans = [tuple(map(int, s.split(":"))) for s in lines[0][3].split(",")]
    assert spans == [(p * 2, p * 2 + 2)]  # tiny: 4 rows, 2 per process
    assert [line[0] for line in lines] == [str(s) for s in range(STEPS)]
    for (_, digest, _, _), batch in zip(lines, expected):
      mine = {k: np.concatenate([v[a:b] for a, b in spans]) for k, v in batch.items()}
      assert digest == steps_lib.batches_sha256([mine])


def _copy(src, dst):
  shutil.copytree(src, dst)
  return dst


# Heavy tier: three more runs (~60 s); one process's exact resume is test_train.py's
@pytest.mark.heavy
def test_stop_and_resume_within_and_across_process_counts(corpus, runs):
  """stop_at 3 with 2 processes, then on to 6 with 2 processes and (a copy) with 1 process x 4
  devices; and the reverse: stopped with 1 process, resumed with 2. All equal the straight run."""
  tmp, want = runs["tmp"], summary(runs["one"])["params_sha256"]
  two = runs["stopped_two"]
  assert workdir_lib.checkpoint_steps(str(two)) == [3]
  two_to_one = _copy(two, tmp / "stop_two_then_one")
  one = tmp / "stop_one"
  train(corpus, one, 1, "--config.train.stop_at=3")
  one_to_two = _copy(one, tmp / "stop_one_then_two")

  (_, out, _), _ = train(corpus, two, 2)
  assert "resuming at step 3/6" in out
  (_, out, _), = train(corpus, two_to_one, 1)
  assert "resuming at step 3/6" in out
  (_, out, _), _ = train(corpus, one_to_two, 2)
  assert "resuming at step 3/6" in out
  for wd in (two, two_to_one, one_to_two):
    assert summary(wd)["params_sha256"] == want, wd
    assert batch_hashes(wd) == batch_hashes(runs["one"]), wd


# Heavy tier: ~40 s; one process's kill -9 is test_train.py's, exit 6 test_distributed.py's
@pytest.mark.heavy
def test_a_killed_process_ends_its_peer_and_the_run_resumes_exactly(corpus, runs):
  """SIGKILL of process 1 once the run is under way: process 0 exits non-zero within the
  heartbeat timeout, naming how the peer was lost (exit 6, or JAX's line naming the task); the
  checkpoint saved before stays loadable and a rerun ends with the straight run's params."""
  wd = runs["killed"]
  procs = start(corpus, wd, 2)
  for line in procs[0].stdout:  # process 0's console, line by line
    if line.startswith("resuming at step 3"):
      break
  procs[1].send_signal(signal.SIGKILL)
  t_kill = time.time()
  try:
    _, stderr0 = procs[0].communicate(timeout=TIMEOUT_S + 60)
  except subprocess.TimeoutExpired:
    procs[0].kill()
    raise AssertionError(f"process 0 still running {TIMEOUT_S + 60} s after its peer was "
                         "killed") from None
  procs[1].communicate()
  assert procs[1].returncode == -signal.SIGKILL
  assert time.time() - t_kill < TIMEOUT_S + 30
  # Either a collective with the dead peer fails first (gloo: "Connection closed by peer"), and
  # training says so in one line and exits 6, not 4 (a checkpoint failure); or JAX's
  # coordination service ends the process, naming the task that stopped sending heartbeats.
  lost = [line for line in stderr0.splitlines()
          if line.startswith("error: lost a peer process: ")]
  assert ((procs[0].returncode == distributed.EXIT_PEER_LOST and len(lost) == 1)
          or (procs[0].returncode not in (0, 4) and "stopped sending heartbeats" in stderr0
              and "\n1\n" in stderr0)), (procs[0].returncode, stderr0[-2000:])
  assert summary(wd)["step"] == 3  # the stopped run's record: the killed one never finished
  assert workdir_lib.checkpoint_steps(str(wd)) == [3]
  (_, out, _), _ = train(corpus, wd, 2)
  assert "resuming at step 3/6" in out
  assert summary(wd)["params_sha256"] == summary(runs["one"])["params_sha256"]


# Heavy tier: ~40 s; one process's SIGTERM and resume are test_train.py's
@pytest.mark.heavy
def test_sigterm_to_both_processes_saves_one_step_and_resumes_exactly(corpus, runs):
  """SIGTERM to both processes once the run is under way (a preemption, scancel): JAX's
  preemption sync stops both at the same step, they save it together and exit 0, and a rerun
  ends with the straight run's params."""
  wd = runs["sigterm"]
  procs = start(corpus, wd, 2)
  for line in procs[0].stdout:  # process 0's console, line by line
    if line.startswith("resuming at step 3"):
      break
  for p in procs:
    p.send_signal(signal.SIGTERM)
  (_, out0, _), (_, out1, _) = finish(procs, timeout=TIMEOUT_S + 120)  # both exit 0
  saved = [int(line.split()[4].rstrip(",")) for line in out0.splitlines()
           if line.startswith("signal 15: saved step")]
  assert len(saved) == 1 and 3 < saved[0] <= STEPS, out0[-2000:]
  step = saved[0]
  assert workdir_lib.checkpoint_steps(str(wd)) == [3, step]  # one step folder, both processes'
  assert summary(wd)["step"] == step and summary(wd)["interrupted"] is True
  (_, out, _), _ = train(corpus, wd, 2)
  assert f"resuming at step {step}/{STEPS}" in out or step == STEPS
  assert summary(wd)["params_sha256"] == summary(runs["one"])["params_sha256"]
  assert batch_hashes(wd) == batch_hashes(runs["one"])


def test_a_peer_that_never_arrives_is_one_line_not_a_hang(corpus, tmp_path):
  env = env_for(corpus, 2, JAX_COORDINATOR_ADDRESS=distributed.free_local_address(),
                JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0")
  t0 = time.time()
  p = subprocess.run(train_cmd(corpus, tmp_path / "w", "--config.mesh.distributed_timeout_s=3"),
                     env=env, capture_output=True, text=True, timeout=120)
  assert p.returncode == distributed.EXIT_PEERS_MISSING, p.stderr[-2000:]
  assert time.time() - t0 < 60
  lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
  assert lines == [
      "error: config.mesh.distributed_timeout_s: process 0 of 2 waited 3 s at "
      f"{env['JAX_COORDINATOR_ADDRESS']} and not every process arrived; start all of them with "
      "the same coordinator address and process count, each with its own process id"]
  assert not os.path.exists(tmp_path / "w")  # nothing written


def _mesh(**fields):
  c = config_lib.base_config().mesh
  for k, v in fields.items():
    setattr(c, k, v)
  return c


@pytest.mark.parametrize("env,fields,message", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two"}, {},
     "JAX_NUM_PROCESSES: must be an integer, got 'two'"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     {}, "JAX_COORDINATOR_ADDRESS: must be HOST:PORT (port 1-65535), got 'localhost'"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, {},
     "JAX_PROCESS_ID: must be in [0, 2) (JAX_NUM_PROCESSES = 2), got 2"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1"}, {}, "JAX_NUM_PROCESSES / config.mesh.num_processes and "
     "JAX_PROCESS_ID / config.mesh.process_id: required with a coordinator address"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, {},
     "JAX_COORDINATOR_ADDRESS: required with JAX_NUM_PROCESSES"),
    ({}, {"coordinator_address": "h:99999", "num_processes": 2, "process_id": 0},
     "config.mesh.coordinator_address: must be HOST:PORT"),
])
def test_bad_launch_values_name_the_field(monkeypatch, env, fields, message):
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
              "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(var, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  with pytest.raises(ValueError) as e:
    distributed.maybe_initialize_distributed(_mesh(**fields))
  assert str(e.value).startswith(message), str(e.value)


def test_config_fields_win_over_the_environment(monkeypatch):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "envhost:1")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  got = distributed.cluster_from(_mesh(coordinator_address="cfg:2", num_processes=2, process_id=1))
  assert got == distributed.Cluster("cfg:2", 2, 1)
  assert distributed.cluster_from(_mesh()) == distributed.Cluster("envhost:1", 4, 3)


@pytest.mark.parametrize("module", ["mtp_jax.generate", "mtp_jax.evaluate",
                                    "mtp_jax.evaluation.tasks_eval"])
def test_one_process_tools_refuse_a_multiprocess_launch(module, tmp_path):
  env = dict(env_for({"cache": ""}, 1), SLURM_STEP_NUM_TASKS="2")  # refused before the workdir
  p = subprocess.run([sys.executable, "-m", module, "--workdir", str(tmp_path)], env=env,
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 2
  assert p.stderr.strip().splitlines()[-1].startswith(
      f"error: python -m {module} runs in one process, but its launcher started 2"), p.stderr
