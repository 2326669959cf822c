"""Sharding on 8 simulated CPU devices: sharded = one device, for every head kind and the meshes
(data, fsdp, tensor) = (8,1,1), (1,8,1), (2,2,2); the padded byte vocabulary on (2,2,2); FSDP
memory per device; checkpoints restored
on another mesh; decoding on a mesh; clear errors; the memory planner at a small size.

The device count is fixed when jax starts, so the 8-device checks run in their own process
(tests/sharding_check.py, once for the module and tier; the JSON it writes is what these tests
read) and the rest of the suite keeps one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from mtp_jax import sharding as shard_lib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MESHES = ("8,1,1", "1,8,1", "2,2,2")
KINDS = ("parallel", "projection", "sequential")
HEADS_ON_TENSOR = ("parallel/2,2,2/mtp_heads=tensor/n2", "sequential/2,2,2/mtp_heads=tensor/n3")


def _run(args, timeout=600):
  """A child python with this process's XLA_FLAGS (conftest's fast-compile flags) on CPU."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)


def _check(tmp_path_factory, checks):
  out = tmp_path_factory.mktemp("sharding") / "results.json"
  proc = _run([os.path.join(HERE, "sharding_check.py"), str(out), *checks])
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return _check(tmp_path_factory, ())  # every check but sharding_check.HEAVY_CHECKS


@pytest.fixture(scope="module")
def results_heavy(tmp_path_factory):
  return _check(tmp_path_factory, ("loss_grads_one_axis", "byte_vocab"))


def _allclose(cmp):
  return cmp["worst_ratio"] <= 1.0


@pytest.mark.slow
def test_runs_on_eight_devices(results):
  assert results["n_devices"] == 8


# Heavy tier: the one-axis meshes (8,1,1) and (1,8,1) (6 compiles, ~20 s of the module's ~100);
# (2,2,2) shards data, fsdp and tensor at once in make test, and (1,8,1) is also make test's mesh
# for FSDP bytes, checkpoints and decoding below.
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mesh", [pytest.param(m, marks=pytest.mark.heavy)
                                  for m in MESHES if m != "2,2,2"] + ["2,2,2"])
def test_loss_and_grads_equal_one_device(request, kind, mesh):
  results = request.getfixturevalue("results" if mesh == "2,2,2" else "results_heavy")
  r = results["loss_grads"][f"{kind}/{mesh}"]
  assert _allclose(r["loss_cmp"]), r
  assert _allclose(r["head_loss_cmp"]), r
  assert _allclose(r["grads_cmp"]), r["grads_cmp"]
  if mesh != "8,1,1":  # pure data parallelism replicates every param
    assert r["sharded_leaves"] > 0
  assert r["activation_constraints"] > 0  # block outputs pinned (sharding.activation_rules)


@pytest.mark.slow
def test_family_features_shard(results):
  """q/k/v biases split over `tensor` like their heads; loss and gradients equal one device's
  with biases, q/k norms, a head_dim of its own, llama3 RoPE and a sliding window (the parallel
  runs of test_loss_and_grads_equal_one_device carry these features on every mesh)."""
  r = results["loss_grads"]["parallel/2,2,2"]
  assert r["family"] and _allclose(r["loss_cmp"]) and _allclose(r["grads_cmp"]), r
  assert r["bias_specs"] and all(v.startswith("P('tensor'") or v.startswith("P(None, 'tensor'")
                                 for v in r["bias_specs"].values()), r["bias_specs"]


@pytest.mark.slow
@pytest.mark.parametrize("name", HEADS_ON_TENSOR)
def test_stacked_head_axis_sharded_by_a_rule(results, name):
  """("mtp_heads", "tensor") first in the rules: the stacked head params split over `tensor`
  and the loss scan over heads still gives one device's loss and gradients."""
  r = results["loss_grads"][name]
  assert _allclose(r["loss_cmp"]) and _allclose(r["grads_cmp"]), r
  kernels = {k: v for k, v in r["head_specs"].items() if k.endswith("['kernel']")}
  assert kernels and all(v.startswith("P('tensor'") for v in kernels.values()), kernels
  default = results["loss_grads"][name.split("/")[0] + "/2,2,2"]["head_specs"]
  default_kernels = [v for k, v in default.items() if k.endswith("['kernel']")]
  assert default_kernels and all(v.startswith("P(None") for v in default_kernels), default


# Heavy tier (~14 s of the 8-device process): the padded byte vocabulary on (2,2,2); make test
# checks the pad masking on one device (tests/test_vocab_pad.py) and (2,2,2) with a vocabulary
# that needs no padding.
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("kind", ("parallel", "sequential"))
def test_byte_vocabulary_padded_on_tensor_2(results_heavy, kind):
  """259 ids do not split over tensor = 2; padded to 384 rows (model.vocab_multiple) they do,
  and the loss and gradients (pad logits masked) equal one device's."""
  r = results_heavy["loss_grads"][f"{kind}/2,2,2/vocab259"]
  assert _allclose(r["loss_cmp"]) and _allclose(r["head_loss_cmp"]), r
  assert _allclose(r["grads_cmp"]), r["grads_cmp"]
  assert r["embedding_shape"] == [384, 64] and r["embedding_spec"].startswith("P('tensor'"), r
  d = results_heavy["decode"]["sequential/2,2,2/vocab259"]
  assert d["tokens_equal"] and d["lengths_equal"] and d["cycles"] == d["cycles_one_device"], d
  assert d["max_token"] < 259


@pytest.mark.slow
def test_train_step_on_mesh_equals_one_device(results):
  """One real step (AdamW update, donated state, sharded optimizer state) on (2,2,2)."""
  r = results["train_step_2,2,2"]
  assert _allclose(r["params_cmp"]) and _allclose(r["metrics_cmp"]), r


@pytest.mark.slow
def test_train_step_has_no_full_rematerialization(results):
  """XLA logged no "Involuntary full rematerialization" while partitioning the (2,2,2) step: a
  lookup in the embedding table as stored (embed over fsdp) made it replicate the looked-up rows
  and their gradient whole on every device on a (data, fsdp) mesh. The control, that lookup
  alone, shows such a line does reach the captured log."""
  r = results["train_step_2,2,2"]
  assert r["remat_control"], "the control logged no rematerialization: is the log captured?"
  assert r["remat_warnings"] == [], r["remat_warnings"]


@pytest.mark.slow
def test_fsdp8_bytes_per_device(results):
  """Params and Adam moments: device 0 holds ~1/8 (norm scales stay replicated)."""
  b = results["bytes_fsdp8"]
  for what in ("params", "opt"):
    share = b[f"{what}_device0"] / b[f"{what}_total"]
    assert 1 / 8 <= share < 1.05 / 8, (what, share, b)


@pytest.mark.slow
@pytest.mark.parametrize("target", ("2,2,2", "8,1,1", "1,1,1"))
def test_checkpoint_from_fsdp_restores_on_other_mesh(results, target):
  r = results["checkpoint_from_1,8,1"][target]
  assert r["step"] == 1 and r["values_equal"] and r["shardings_as_asked"], r


@pytest.mark.parametrize("case", ("parallel/2,2,2", "parallel/1,8,1", "sequential/2,2,2",
                                  "sequential/1,8,1"))
@pytest.mark.slow
def test_decode_on_mesh_equals_one_device(results, case):
  r = results["decode"][case]
  assert r["tokens_equal"] and r["lengths_equal"] and r["cycles"] == r["cycles_one_device"], r


@pytest.mark.slow
def test_clear_errors(results):
  e = results["errors"]
  assert e["mesh_2,2,2_on_4_devices"].startswith("config.mesh: data*fsdp*tensor = 8 but there "
                                                 "are 4 devices")
  assert e["mesh_3,-1,1_on_8_devices"].startswith("config.mesh: ")
  assert e["vocab_61_on_tensor_2"].startswith("config.mesh.rules: ")
  assert "'vocab'" in e["vocab_61_on_tensor_2"] and "61" in e["vocab_61_on_tensor_2"]
  assert e["batch_12_on_8_rows"].startswith("config.train.batch_size: ")
  assert e["distributed_bad_mode"].startswith("config.mesh.distributed: ")
  assert e["distributed_off_returns"] is False


def test_mesh_must_match_devices_here(make_config):
  """In this one-device process too, before anything is compiled."""
  c = make_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  with pytest.raises(ValueError, match=r"^config\.mesh: data\*fsdp\*tensor = 8 but there are "
                     f"{jax.device_count()} devices"):
    shard_lib.make_mesh(c)
  c.mesh.data, c.mesh.fsdp = -1, -1
  with pytest.raises(ValueError, match=r"^config\.mesh: at most one"):
    shard_lib.mesh_shape(c, 8)


SMALL = ("--set", "model.vocab_size=256", "--set", "model.d_model=64", "--set", "model.n_heads=4",
         "--set", "model.n_kv_heads=4", "--set", "model.d_ff=128", "--set", "model.n_layers=6",
         "--set", "model.max_len=64", "--set", "data.seq_len=64", "--set", "loss.token_chunks=2",
         "--set", "train.grad_accum=2", "--batch", "16")


# Heavy tier: plan_memory.py's smoke (two compiles on 8 devices, ~16 s); per-device FSDP bytes
# are test_fsdp8_bytes_per_device's in make test, the planner's bad mesh the test below.
@pytest.mark.heavy
@pytest.mark.slow
def test_plan_memory_small(tmp_path):
  """The 7B preset shrunk by overrides, 8 devices, fsdp 8: both compiles, per-device numbers."""
  out = tmp_path / "plan.json"
  proc = _run(["experiments/plan_memory.py", "--config", "configs/paper_7b_n4.py",
               "--devices", "8", "--mesh", "fsdp=8", *SMALL, "--json", str(out)])
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "n_future=4: peak" in proc.stdout and "fits in 16 GiB per chip" in proc.stdout
  mtp, ntp = json.loads(out.read_text())["records"]
  assert (mtp["n_future"], ntp["n_future"]) == (4, 1)
  assert mtp["n_params"] == ntp["n_params"]  # parallel heads: matched parameters
  for r in (mtp, ntp):
    assert r["devices"] == 8 and r["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    # memory_analysis is per device: the arguments are this device's state shard + batch rows
    batch_rows = 2 * 16 * 64 * 4 // 8
    assert r["state_bytes_per_device"] <= r["argument_bytes"] <= (
        r["state_bytes_per_device"] + batch_rows + 4096)
    assert r["alias_bytes"] > 0.9 * r["state_bytes_per_device"]  # the state is donated
    assert r["temp_bytes"] > 0
    assert r["peak_bytes"] >= r["argument_bytes"] + r["temp_bytes"]


def test_plan_memory_bad_mesh():
  proc = _run(["experiments/plan_memory.py", "--config", "configs/paper_7b_n4.py",
               "--devices", "8", "--mesh", "fsdp=3", "--no_baseline"], timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.startswith("error: config.mesh: ")
