"""experiments/profile_decode.py: the decoding loop's body profiled op by op (a tiny random model,
two batch sizes, a few tokens); experiments/profile_train.py: the tiny config's train step, mtp_jax
and PyTorch, op classes side by side; experiments/bench_decode_options.py: the decoding program
under each compile-option set, one process."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_config, tiny_model
from experiments import bench_decode_options, hlo_profile, profile_decode, profile_train
from mtp_jax.convert.workdir import write_workdir

# Heavy tier, the whole file (~23 s): smokes of the profiling scripts (op classes of the decode
# body and the train step, compile-option sets); the programs they profile are tested in make test.
pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  c = tiny_config("parallel", n_future=2)
  _, params = tiny_model(c)
  wd = str(tmp_path_factory.mktemp("profile") / "wd")
  write_workdir(wd, c, params)
  return wd


def test_profile_names_the_body_ops_and_their_classes(workdir, tmp_path, capsys):
  out = tmp_path / "p.json"
  assert profile_decode.main(["--workdir", workdir, "--batches", "1,2", "--reps", "1",
                              "--max_new", "6", "--prompt_len", "4", "--top", "5",
                              "--json", str(out)]) == 0
  records = json.loads(out.read_text())
  assert [r["batch"] for r in records] == [1, 2]
  for r in records:
    assert r["machine"]["cpu_count"] and r["forwards"] == 6  # prefill + 5 one-token steps
    assert 0 < r["ops_timed"] <= r["ops_in_body"] and len(r["top_ops"]) <= 5
    assert r["top_ops"] == sorted(r["top_ops"], key=lambda o: -o["us_per_call"] * o["calls"])
    assert r["top_ops"] and all(o["calls"] >= 5 for o in r["top_ops"])  # once per step, at least
    classes = {c.replace(" (library)", "") for c in r["share_by_class"]}
    assert "dot" in classes, classes  # the weights' (the tiny attention's are reduce fusions)
    assert abs(sum(r["share_by_class"].values()) - 1) < 0.01 and r["coverage"] > 0
    assert r["compile_options"] is None  # pytest: the CPU defaults' flag is not in XLA_FLAGS


def test_bench_decode_options_same_tokens_and_names_the_rule(workdir, tmp_path):
  out = tmp_path / "o.json"
  assert bench_decode_options.main(["--workdir", workdir, "--batches", "1,2", "--rounds", "3",
                                    "--max_new", "4", "--prompt_len", "4", "--options",
                                    "eigen,ynn,xla", "--json", str(out)]) == 0
  records = json.loads(out.read_text())
  assert [r["batch"] for r in records] == [1, 2]
  for r in records:
    assert r["tokens_equal"] and r["baseline"] == "eigen" and r["machine"]["cpu_count"]
    assert r["rule"] == "eigen"  # pytest: the CPU defaults' flag is not in XLA_FLAGS
    assert set(r["speed_over_baseline"]) == {"ynn", "xla"}
    assert all(len(s) == 3 for s in r["seconds"].values())
  with pytest.raises(SystemExit):
    bench_decode_options.main(["--workdir", workdir, "--options", "eigen,fast"])


def test_profile_train_classes_both_frameworks(tmp_path):
  out = tmp_path / "t.json"
  assert profile_train.main(["--config", "configs/tiny.py", "--n_future", "2", "--steps", "1",
                             "--reps", "1", "--top", "4", "--json", str(out)]) == 0
  records = json.loads(out.read_text())
  assert [(r["framework"], r["n_future"]) for r in records] == [("jax", 2), ("torch", 2)]
  for r in records:
    assert abs(sum(r["share_by_class"].values()) - 1) < 0.01 and r["coverage"] > 0
    assert r["step_ms_untraced"] > 0 and len(r["top_ops"]) == 4 and r["machine"]["cpu_count"]
    assert "dot" in r["ms_by_class"], r["ms_by_class"]
  torch_classes = set(records[1]["ms_by_class"])
  assert {"attention", "optimizer", "elementwise"} <= torch_classes, torch_classes
  assert records[0]["ops_timed"] <= records[0]["ops_in_step"]


SCOPE = "jit(f)/while/body/MTPModel/trunk/layers_0/attention"


def test_while_body_ops_classes():
  hlo = """HloModule m

%fused_dot (p: f32[2,8]) -> f32[2,4] {
  %d = f32[2,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (s: (f32[2,8])) -> (f32[2,8]) {
  %ynn_fusion.1 = f32[2,4]{1,0} fusion(%x), kind=kCustom, calls=%fused_dot
  %dot.2 = f32[2,4,1,9]{3,2,1,0} dot(%q, %k), lhs_batch_dims={0,1}, metadata={op_name="QK"}
  %dot.4 = f32[2,4,8]{2,1,0} dot(%h, %w), lhs_batch_dims={0}, metadata={op_name="PROJ"}
  %dot.5 = f32[4,2,9]{2,1,0} dot(%q1, %k1), lhs_batch_dims={0}, lhs_contracting_dims={2}
  %copy.3 = f32[2]{0} copy(%y)
  %add_fusion = f32[2,8]{1,0} fusion(%z), kind=kLoop, calls=%fused_add
  %inner = (s32[], f32[4]{0}, /*index=2*/f32[2,8]{1,0}) while(%u), condition=%c2, body=%b2
}

ENTRY %main (p: f32[2,8]) -> f32[2,8] {
  %w = (f32[2,8]) while(%t), condition=%cond, body=%body
}
""".replace("QK", f"{SCOPE}/bkqe,bkte->bkqt/dot_general").replace(
      "PROJ", f"{SCOPE}/...f,fg->...g/dot_general")
  ops = hlo_profile.while_body_ops(hlo)
  assert {n: (o["class"], o["library"]) for n, o in ops.items()} == {
      "ynn_fusion.1": ("dot", True), "dot.2": ("attention dot", False),
      "dot.4": ("dot", False), "dot.5": ("attention dot", False),
      "copy.3": ("copy", False), "add_fusion": ("elementwise", False),
      "inner": ("loop", False)}
  with pytest.raises(ValueError, match="no while loop"):
    hlo_profile.while_body_ops("HloModule m\n")
  assert hlo_profile.entry_name(hlo) == "main"
