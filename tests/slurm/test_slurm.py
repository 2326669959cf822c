"""A real Slurm (tests/slurm/cluster.py: munged, slurmctld and slurmd on localhost, everything
under a temp folder): `srun -n 2` training through JAX's own Slurm detection, and sweeps
submitted as one `sbatch --array` job (`experiments/sweep.py --launcher slurm`): the local
launcher's results, attaching to a running array, and a cancelled array resumed by the next call.

`make test-slurm` runs this directory (the main pytest run ignores it). Where Slurm cannot be
installed or started the tests are skipped, except under CI, where they fail."""

from __future__ import annotations

import csv
import glob
import json
import os
import subprocess
import time

import pytest
from cluster import SlurmCluster, SlurmUnavailable
from conftest import copy_code_corpus, micro_sweep, sweep_cmd, train_cmd

pytestmark = pytest.mark.slurm  # (conftest marks the folder too)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cluster():
  """A running one-node cluster; SLURM_CONF exported to this process (and so to every
  subprocess) while it runs. Stopped at the end, whatever happens (and at exit)."""
  c = SlurmCluster()
  try:
    c.start()
  except SlurmUnavailable as e:
    c.stop()
    if os.environ.get("CI"):
      pytest.fail(f"CI is set and Slurm does not start here: {e}", pytrace=False)
    pytest.skip(f"no Slurm here: {e}")
  old = os.environ.get("SLURM_CONF")
  os.environ["SLURM_CONF"] = c.conf
  try:
    yield c
  finally:
    if old is None:
      os.environ.pop("SLURM_CONF", None)
    else:
      os.environ["SLURM_CONF"] = old
    c.stop()


@pytest.fixture(scope="module")
def corpus(cluster, tmp_path_factory):
  corpus = copy_code_corpus(tmp_path_factory.mktemp("slurm_corpus"))
  corpus["env"] = dict(os.environ, JAX_COMPILATION_CACHE_DIR=corpus["cache"],
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
  return corpus


def run(cmd, env, timeout=300, **kw):
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                        stdin=subprocess.DEVNULL, cwd=ROOT, **kw)


def read_json(path):
  with open(path) as f:
    return json.load(f)


def test_srun_two_processes_equal_one_process(corpus, tmp_path):
  """`srun -n 2` (one CPU device per task) trains through JAX's Slurm detection
  (mesh.distributed auto) and ends with the params of one process with 2 devices on the same
  mesh; process 0 alone prints and writes summary.json."""
  steps = ["--config.train.steps=4", "--config.train.eval_every=4",
           "--config.train.checkpoint_every=4", "--config.mesh.data=2"]
  two, one = tmp_path / "two", tmp_path / "one"
  env = dict(corpus["env"], XLA_FLAGS=(corpus["env"].get("XLA_FLAGS", "")
                                       + " --xla_force_host_platform_device_count=2").strip())
  q = run(train_cmd(corpus, one, *steps), env)  # first: it builds the data set
  assert q.returncode == 0, q.stdout[-3000:] + q.stderr[-3000:]
  p = run(["srun", "-n", "2", "-c", "1", "--label", *train_cmd(corpus, two, *steps)],
          corpus["env"])
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  out = p.stdout + p.stderr
  assert out.count("starting step 0/4") == 1, out[-3000:]  # process 0 alone prints
  assert sorted(glob.glob(str(tmp_path / "**" / "summary.json"), recursive=True)) == [
      str(one / "summary.json"), str(two / "summary.json")]
  s2, s1 = read_json(two / "summary.json"), read_json(one / "summary.json")
  assert s2["step"] == s1["step"] == 4
  assert s2["params_sha256"] == s1["params_sha256"]


@pytest.fixture(scope="module")
def two_points(tmp_path_factory):
  """The micro sweep's two smallest runs (d_model 32, n_future 1 and 2)."""
  return micro_sweep(tmp_path_factory.mktemp("sweep_file") / "micro2.py", "micro.get_runs()[:2]")


def sweep_record(root):
  record = read_json(root / "sweep.json")
  with open(root / "results.csv", newline="") as f:
    reader = csv.DictReader(f)
    return record, reader.fieldnames, list(reader)


def test_sweep_on_slurm_matches_local(corpus, two_points, tmp_path):
  """--launcher slurm: submitted with --no_wait, then followed to its end by the same command
  (attached to the running array, nothing submitted twice); sweep.json and results.csv as the
  local launcher writes them; a third call skips both runs."""
  local, on_slurm = tmp_path / "local", tmp_path / "slurm"
  p = run(sweep_cmd(two_points, local, corpus, "--parallel", "2"), corpus["env"])
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

  cmd = sweep_cmd(two_points, on_slurm, corpus, "--launcher", "slurm")
  p = run(cmd + ["--no_wait"], corpus["env"], timeout=60)
  assert p.returncode == 0 and "submitted 2 run(s) as array job" in p.stdout, p.stdout + p.stderr
  job = read_json(on_slurm / "slurm" / "array_0.json")["job_id"]
  p = run(cmd, corpus["env"])
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert "as array job" not in p.stdout, p.stdout  # nothing submitted again
  assert p.stdout.count(f"following slurm task {job}_") == 2, p.stdout
  assert "[2/2]" in p.stdout and "done in" in p.stdout and "elapsed" in p.stdout
  assert "2 trained, 0 skipped, 0 failed" in p.stdout, p.stdout

  rec_l, cols_l, rows_l = sweep_record(local)
  rec_s, cols_s, rows_s = sweep_record(on_slurm)
  assert [r["status"] for r in rec_s["runs"]] == [r["status"] for r in rec_l["runs"]] == [
      "done", "done"]
  assert cols_s == cols_l and [r["status"] for r in rows_s] == ["done", "done"]
  assert set(rec_s) - set(rec_l) == {"slurm"} and rec_s["slurm"]["jobs"] == [job]
  for a, b in zip(rec_s["runs"], rec_l["runs"]):
    assert set(a) == set(b) and a["name"] == b["name"] and a["returncode"] == 0
    assert a["command"][a["command"].index("--workdir") + 1] == a["workdir"]
    log = open(os.path.join(a["workdir"], "train.log")).read()
    assert f"=== sweep (slurm task {job}_" in log and "starting step 0/10" in log
  for a, b in zip(rows_s, rows_l):  # the same runs: the same figures
    assert (a["name"], a["n_params"], a["tokens_seen"]) == (b["name"], b["n_params"],
                                                            b["tokens_seen"])

  p = run(cmd, corpus["env"], timeout=60)
  assert p.returncode == 0 and "0 trained, 2 skipped, 0 failed" in p.stdout, p.stdout + p.stderr
  assert "as array job" not in p.stdout and "following" not in p.stdout


def wait_for(predicate, timeout, what):
  deadline = time.time() + timeout
  while time.time() < deadline:
    value = predicate()
    if value:
      return value
    time.sleep(0.2)
  raise AssertionError(f"{what}: not within {timeout} s")


def checkpointed(root):
  """(workdir, step) of a run with a finished checkpoint (orbax's tmp folders do not count)."""
  for wd in sorted(glob.glob(str(root / "*" / "checkpoints"))):
    steps = [int(n) for n in os.listdir(wd) if n.isdigit()]
    if steps:
      return os.path.dirname(wd), max(steps)
  return None


def test_cancelled_array_resumes_on_rerun(corpus, two_points, tmp_path):
  """scancel of the array while sweep.py follows it: the runs save a checkpoint (SIGTERM) and
  sweep.py reports them interrupted (exit 1); the next call resubmits them, they resume from
  their checkpoints and finish."""
  root = tmp_path / "root"
  cmd = sweep_cmd(two_points, root, corpus, "--launcher", "slurm") + [
      "train.steps=150", "train.checkpoint_every=5", "train.eval_every=150"]
  first = subprocess.Popen(cmd, env=corpus["env"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
  try:
    workdir, step = wait_for(lambda: checkpointed(root), 120, "a checkpoint")
    job = read_json(root / "slurm" / "array_0.json")["job_id"]
    assert run(["scancel", job], corpus["env"], timeout=30).returncode == 0
    out, _ = first.communicate(timeout=120)
  finally:
    if first.poll() is None:
      first.kill()
  assert first.returncode == 1, out
  record = read_json(root / "sweep.json")
  assert [r["status"] for r in record["runs"]] == ["interrupted", "interrupted"], out
  assert "0 trained, 0 skipped, 0 failed, 2 interrupted" in out, out

  p = run(cmd, corpus["env"])
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert "submitted 2 run(s) as array job" in p.stdout and "resume from step" in p.stdout
  assert "2 trained, 0 skipped, 0 failed" in p.stdout, p.stdout
  record = read_json(root / "sweep.json")
  assert [r["status"] for r in record["runs"]] == ["done", "done"]
  assert record["slurm"]["jobs"] != [job]
  log = open(os.path.join(workdir, "train.log")).read()
  resumed = [int(line.split()[3].split("/")[0]) for line in log.splitlines()
             if line.startswith("resuming at step ")]
  assert resumed and resumed[-1] >= step, log[-3000:]
  assert read_json(os.path.join(workdir, "summary.json"))["step"] == 150
