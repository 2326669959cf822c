"""experiments/cpu_bench_report.py: `make cpu-bench`'s records read back (the row of
docs/cpu_speed.md's machines table, the CPU targets, the decoding options' rule), on records
kept in the repo and on made-up ones."""

from __future__ import annotations

import json
import os

import pytest

from experiments import cpu_bench_report as report_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _machines_table() -> str:
  """The table rows of docs/cpu_speed.md's "The machines" section (up to its next heading)."""
  with open(os.path.join(ROOT, "docs", "cpu_speed.md")) as f:
    text = f.read()
  section = text.split("\n## The machines\n", 1)[1].split("\n#", 1)[0]
  return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def test_kept_records_give_the_table_row():
  """The family-25 model-17 EPYC's records: the row docs/cpu_speed.md quotes, every figure the
  benchmark's own ratio, and the machine they were measured on (not this one)."""
  rec = report_lib.report("epyc_f25m17")
  assert rec["missing"] == []
  assert rec["table_row"] in _machines_table()
  with open(os.path.join(report_lib.RESULTS, "bench_train_peer_epyc_f25m17.json")) as f:
    peer = json.load(f)
  assert rec["figures"]["train n_future 4"]["ratio"] == peer[1]["jax_over_torch_tokens_per_sec"]
  assert rec["machine"] == peer[0]["machine"] and rec["machine"]["cpu_model_id"] == 17
  assert set(rec["targets"]) == set(report_lib.TARGETS)
  assert [v["batch"] for v in rec["decode_options"]] == [1, 2, 4, 8]
  assert all(v["rule"] == v["fastest"] == "ynn" and not v["revisit_rule"]
             for v in rec["decode_options"])
  assert set(rec["one_core_jax_over_torch"]) == {1, 4}


def test_the_xeon_records_give_the_table_row():
  """The model-167 AMX Xeon's latest records (after mimalloc, its batch-1 rule, the one-loop
  SwiGLU gradient and MKL's GEMMs): docs/cpu_speed.md's row, every CPU target met, and
  YNNPACK's dots the fastest decoding set at every batch, as the rule now picks there."""
  rec = report_lib.report("xeon_m167_mkl")
  assert rec["missing"] == []
  assert rec["table_row"] in _machines_table()
  for name, target in report_lib.TARGETS.items():
    assert rec["figures"][name]["ratio"] >= target, name
  assert rec["machine"]["cpu_vendor"] == "GenuineIntel" and rec["machine"]["cpu_model_id"] == 167
  assert rec["decode_options"]
  assert all(v["rule"] == v["fastest"] == "ynn" for v in rec["decode_options"])
  before = report_lib.report("xeon_m167_before")
  assert before["decode_options"][0]["rule"] == "eigen" and before["decode_options"][0][
      "revisit_rule"]


def _write(folder, name, records):
  with open(os.path.join(folder, name), "w") as f:
    json.dump(records, f)


def test_targets_missing_records_and_a_rule_to_revisit(tmp_path, capsys):
  machine = {"cpu_model": "Some Xeon", "isa": {"avx2": True, "avx512f": True, "amx_tile": True},
             "cpu_count": 2, "cpu_vendor": "GenuineIntel", "cpu_family": 6, "cpu_model_id": 143}
  _write(tmp_path, "bench_train_peer_x.json", [
      {"n_future": 1, "jax_over_torch_tokens_per_sec": 0.97,
       "jax_over_torch_same_round_median": 0.99, "machine": machine},
      {"n_future": 4, "jax_over_torch_tokens_per_sec": 0.91,
       "jax_over_torch_same_round_median": 0.9, "machine": machine}])
  _write(tmp_path, "bench_decode_options_x.json", [
      {"batch": 1, "heads": 1, "baseline": "eigen", "rule": "eigen", "tokens_equal": True,
       "speed_over_baseline": {"ynn": {"median": 1.3, "quartiles": [1.2, 1.4]}}},
      {"batch": 2, "heads": 1, "baseline": "eigen", "rule": "ynn", "tokens_equal": True,
       "speed_over_baseline": {"ynn": {"median": 1.05, "quartiles": [0.9, 1.2]}}},
      {"batch": 4, "heads": 1, "baseline": "eigen", "rule": "xla", "tokens_equal": True,
       "speed_over_baseline": {"ynn": {"median": 1.1, "quartiles": [1.0, 1.2]}}}])
  rec = report_lib.report("x", str(tmp_path))
  assert rec["missing"] == ["bench_decode_hf", "profile_train"]
  assert rec["targets"]["train n_future 1"]["met"] is False
  assert rec["targets"]["train n_future 4"]["met"] is True
  assert "greedy batch 1" not in rec["targets"]
  assert rec["table_row"] == ("| Some Xeon (family 6, model 143), AVX-512 + AMX | 0.97x | "
                               "0.91x | - | - | bench_train_peer_x.json, "
                               "bench_decode_hf_x.json |")
  one, two, four = rec["decode_options"]
  assert (one["fastest"], one["revisit_rule"], one["fastest_over_rule"]) == ("ynn", True, 1.3)
  assert (two["fastest"], two["revisit_rule"]) == ("ynn", False)
  assert (four["revisit_rule"], four["fastest_over_rule"]) == (None, None)  # xla not measured
  assert report_lib.main(["--tag", "x", "--results", str(tmp_path)]) == 0
  err = capsys.readouterr().err
  assert "train n_future 1: 0.970x (same-round 0.990x), target >= 1.0x: NOT met" in err
  assert "batch 1: the rule's set eigen: ynn faster, 1.3x (beyond the quartiles" in err
  assert "batch 2: the rule's set ynn: the fastest set" in err
  assert "batch 4: the rule's set xla: not measured (fastest of those run: ynn)" in err
  assert "Some Xeon (vendor GenuineIntel, family 6, model 143); 2 cores; avx2, avx512f" in err


def test_unknown_tag_is_one_line_naming_the_flag(tmp_path, capsys):
  with pytest.raises(SystemExit):
    report_lib.main(["--tag", "nowhere", "--results", str(tmp_path)])
  assert "--tag: no record of bench_train_peer" in capsys.readouterr().err
