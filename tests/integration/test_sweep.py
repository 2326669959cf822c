"""Scaling-law sweeps end to end: the micro sweep (plus one run with a bad override) through the
CLI once, its results.csv, skip-on-rerun, failure reporting, the power-law fit and the analysis.
Subprocesses share a compilation cache and the fast-compile XLA flags of conftest.py."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import copy_code_corpus, micro_sweep, sweep_cmd

from mtp_jax.sweeps import scaling
from mtp_jax.sweeps import sweep as sweep_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MICRO = os.path.join(ROOT, "experiments", "sweeps", "micro.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  corpus = copy_code_corpus(tmp_path_factory.mktemp("sweep_corpus"))
  corpus["env"] = dict(os.environ, JAX_COMPILATION_CACHE_DIR=corpus["cache"],
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
  return corpus


@pytest.fixture(scope="module")
def micro(corpus, tmp_path_factory):
  """The micro sweep with a run whose override fails validation (n_future 9 > n_layers 3: exit
  2) put first, so the runs after it must still start; two at a time. Runs once."""
  tmp = tmp_path_factory.mktemp("sweep")
  sweep_file = micro_sweep(tmp / "micro_plus_bad.py",
                           "[{'name': 'bad', 'model.n_future': 9}] + micro.get_runs()")
  root = tmp / "root"
  p = subprocess.run(sweep_cmd(str(sweep_file), root, corpus, "--parallel", "2"),
                     env=corpus["env"], capture_output=True, text=True, timeout=900)
  with open(root / "results.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  with open(root / "sweep.json") as f:
    record = json.load(f)
  return {"root": root, "proc": p, "rows": rows, "record": record}


def good_rows(micro):
  return [r for r in micro["rows"] if r["name"] != "bad"]


def test_results_csv_row_per_run(micro):
  p = micro["proc"]
  assert len(micro["rows"]) == 5, p.stdout + p.stderr
  good = good_rows(micro)
  assert [r["status"] for r in good] == ["done"] * 4, p.stdout[-3000:]
  params = {}
  for r in good:
    n = int(r["n_future"])
    assert n == int(r["model.n_future"]) and r["head_kind"] == "parallel"
    for k in range(1, n + 1):
      assert math.isfinite(float(r[f"eval/head{k}_loss"])) and 0 <= float(r[f"eval/head{k}_acc"])
    assert float(r["head1_eval_loss"]) == float(r["eval/head1_loss"])
    n_params, tokens = int(r["n_params"]), int(r["tokens_seen"])
    assert tokens == 10 * 4 * 32  # steps x batch x seq_len of the micro sweep on tiny.py
    assert float(r["compute"]) == pytest.approx(6 * n_params * tokens)
    assert int(r["n_params_nonembed"]) == n_params - 384 * int(r["model.d_model"])  # 259 -> 384
    agree = [float(r[f"eval/head{k}_agree"]) for k in range(1, n + 1)]
    assert float(r["accept_proxy"]) == pytest.approx(scaling.acceptance_proxy(agree))
    params.setdefault(r["model.d_model"], set()).add(n_params)
  # Parallel heads take their blocks from the trunk: equal parameters across n at one size.
  assert all(len(v) == 1 for v in params.values()) and len(params) == 2
  assert len({v.pop() for v in params.values()}) == 2


def test_failed_run_reported_others_finish(micro):
  p, record = micro["proc"], micro["record"]
  assert p.returncode == 1, p.stderr[-2000:]
  bad = next(r for r in record["runs"] if r["name"] == "bad")
  assert bad["status"] == "failed" and bad["returncode"] == 2
  assert "config.model.n_future" in bad["error"]
  assert "bad: failed" in p.stdout and "exit 2" in p.stdout
  assert "config.model.n_future" in p.stdout  # the log's last lines, under the progress line
  assert sum(r["status"] == "done" for r in record["runs"]) == 4
  row = next(r for r in micro["rows"] if r["name"] == "bad")
  assert row["status"] == "failed" and row["head1_eval_loss"] == ""
  assert "[5/5]" in p.stdout and "ETA" in p.stdout and "elapsed" in p.stdout
  assert "4 trained, 0 skipped, 1 failed" in p.stdout


def test_rerun_skips_finished_runs(micro, corpus):
  """Nothing is retrained: no process is launched (no returncode, no log line), and no file of
  a workdir is touched."""
  root = micro["root"]

  def snapshot():
    out = {}
    for r in good_rows(micro):
      wd = root / r["name"]
      out[r["name"]] = [(f, os.stat(wd / f).st_size, os.stat(wd / f).st_mtime_ns) for f in (
          "train.log", "metrics.jsonl", "summary.json", "config.json")] + [
              sorted(os.listdir(wd / "checkpoints"))]
    return out
  before = snapshot()
  p = subprocess.run(sweep_cmd(MICRO, root, corpus, "--parallel", "2"), env=corpus["env"],
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stdout + p.stderr
  assert p.stdout.count("skipped, finished earlier") == 4
  assert "0 trained, 4 skipped, 0 failed" in p.stdout
  record = json.loads((root / "sweep.json").read_text())
  assert [(r["status"], r["state"], r["returncode"]) for r in record["runs"]] == [
      ("skipped", "finished", None)] * 4
  assert snapshot() == before


def test_sweep_modules_import_no_jax():
  """A rerun that skips everything costs no jax start-up."""
  code = ("import sys, mtp_jax.sweeps.sweep, mtp_jax.sweeps.scheduler, mtp_jax.sweeps.scaling, "
          "mtp_jax.sweeps.slurm; "
          "print(sorted(m for m in ('jax', 'tensorflow_datasets') if m in sys.modules))")
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                     env=dict(os.environ, PYTHONPATH=ROOT))
  assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_mismatched_workdir_is_not_resumed(micro):
  """A workdir trained with other overrides under the same name is reported, not mixed."""
  sweep = sweep_lib.load_sweep(MICRO)
  run = sweep.runs[0]
  wd = str(micro["root"] / run.name)
  assert sweep_lib.check_workdir(sweep, run, wd)[0] == sweep_lib.WorkdirState.FINISHED
  changed = sweep_lib.Run(run.name, {**run.overrides, "model.d_model": 64})
  state, detail = sweep_lib.check_workdir(sweep, changed, wd)
  assert state == sweep_lib.WorkdirState.MISMATCH and "model.d_model=32" in detail
  record = sweep_lib.plan(sweep_lib.Sweep(sweep.path, sweep.base_config, sweep.common,
                                          [changed]), str(micro["root"]))[0]
  assert record.status == sweep_lib.RunStatus.FAILED and record.error == detail


def test_load_sweep_names_and_errors(tmp_path):
  sweep = sweep_lib.load_sweep(MICRO, {"data.seq_len": 16})
  assert sweep.base_config == os.path.join(ROOT, "configs", "tiny.py")
  assert [r.name for r in sweep.runs][0] == "d_model=32,n_layers=2,d_ff=64,n_future=1,seed=0"
  cmd = sweep_lib.train_command(sweep, sweep.runs[0], "/w")
  assert "--config.data.seq_len=16" in cmd and "--config.model.d_model=32" in cmd
  assert sweep_lib.flag_value(True) == "true" and sweep_lib.flag_value([1, 2]) == "(1, 2)"
  dup = tmp_path / "dup.py"
  dup.write_text("BASE_CONFIG = 'configs/tiny.py'\n"
                 "def get_runs():\n  return [{'seed': 0}, {'seed': 0}]\n")
  with pytest.raises(ValueError, match="share a name"):
    sweep_lib.load_sweep(str(dup))
  missing = tmp_path / "missing.py"
  missing.write_text("BASE_CONFIG = 'configs/nope.py'\ndef get_runs():\n  return [{}]\n")
  with pytest.raises(ValueError, match="BASE_CONFIG"):
    sweep_lib.load_sweep(str(missing))


def test_dry_run_writes_nothing(tmp_path):
  lines = []
  sweep = sweep_lib.load_sweep(MICRO)
  sweep_lib.run_sweep(sweep, str(tmp_path / "r"), 2, dry_run=True, log=lines.append)
  assert not os.path.exists(tmp_path / "r")
  assert len(lines) == 4 and all("-m mtp_jax.train" in line for line in lines)


def test_acceptance_proxy():
  assert scaling.acceptance_proxy([1.0]) == 1.0
  assert scaling.acceptance_proxy([1.0, 0.5, 0.5, 1.0]) == pytest.approx(1 + 0.5 + 0.25 + 0.25)


def test_fit_power_law_recovers_exact_law():
  x = np.geomspace(1e5, 1e8, 5)
  f = scaling.fit_power_law(x, 7.5 * x ** -0.081)
  assert f["a"] == pytest.approx(7.5, rel=1e-9) and f["b"] == pytest.approx(-0.081, abs=1e-12)
  assert f["r2"] == pytest.approx(1.0) and f["points"] == 5
  assert sweep_lib.fit_power_law is scaling.fit_power_law
  with pytest.raises(ValueError, match="two distinct"):
    scaling.fit_power_law([10.0, 10.0], [1.0, 2.0])
  with pytest.raises(ValueError, match="positive"):
    scaling.fit_power_law([1.0, 2.0], [1.0, -1.0])


def test_gain_table_averages_seeds():
  def row(n, params, seed, loss):
    return {"n_future": n, "n_params": params, "seed": seed, "head1_eval_loss": loss,
            "compute": 6.0 * params * 1000, "model.d_model": 8.0}
  rows = [row(1, 100, 0, 3.0), row(1, 100, 1, 3.2), row(4, 100, 0, 3.3), row(4, 100, 1, 3.4),
          row(1, 400, 0, 2.5), row(4, 400, 0, 2.4)]
  small, large = scaling.gain_table(rows)
  assert small["loss_n1"] == pytest.approx(3.1) and small["seeds_n1"] == 2
  assert small["std_n1"] == pytest.approx(np.std([3.0, 3.2], ddof=1))
  assert small["gain_n4"] == pytest.approx(0.25)  # seed by seed: 0.3 and 0.2
  assert small["gain_std_n4"] == pytest.approx(np.std([0.3, 0.2], ddof=1))
  assert large["gain_n4"] == pytest.approx(-0.1) and large["gain_std_n4"] == 0.0
  no_seeds = [{k: v for k, v in r.items() if k != "seed"} for r in rows if r["seed"] == 0]
  assert scaling.gain_table(no_seeds)[0]["gain_n4"] == pytest.approx(0.3)
  assert scaling.gain_table(no_seeds)[0]["gain_std_n4"] is None
  fitted = scaling.fits(rows)
  assert fitted["1"]["params"]["b"] < 0 and fitted["4"]["compute"]["points"] == 2


def test_analyze_cli_writes_png_and_gain_table(micro, tmp_path):
  png, out_json = tmp_path / "plot.png", tmp_path / "analysis.json"
  p = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "analyze_sweep.py"),
                      str(micro["root"]), "--png", str(png), "--json", str(out_json)],
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "| n_params |" in p.stdout and "n=2 - n=1" in p.stdout
  out = json.loads(out_json.read_text())
  assert set(out["fits"]) == {"1", "2"} and out["fits"]["2"]["params"]["points"] == 2
  assert out["fits"]["2"]["params"]["r2"] is None  # two points: no fit quality, said so
  assert "2 sizes: too few points for a fit quality" in p.stdout and "r² 1.000" not in p.stdout
  table = out["table"]
  assert len(table) == 2 and table[0]["n_params"] < table[1]["n_params"]
  for e in table:
    assert e["gain_n2"] == pytest.approx(e["loss_n2"] - e["loss_n1"])
  with open(micro["root"] / "mtp_gain.csv", newline="") as f:
    assert len(list(csv.DictReader(f))) == 2


def test_scheduler_gates_pins_and_forwards_sigterm(tmp_path):
  """The first job runs alone until its log says ready; each slot gets its own CPUs; SIGTERM to
  the scheduler reaches the running jobs, which are reported, and the rest never start."""
  import re
  import signal
  import threading
  from mtp_jax.sweeps import scheduler
  cpus = len(os.sched_getaffinity(0))
  script = ("import os, sys, time; time.sleep(float(sys.argv[1])); "
            "print('ready', sorted(os.sched_getaffinity(0)), flush=True); "
            "time.sleep(float(sys.argv[2]))")
  jobs = [scheduler.Job(name, [sys.executable, "-c", script, wait, run],
                        str(tmp_path / name / "log"))
          for name, wait, run in (("a", "0.8", "1.5"), ("b", "0", "0"), ("c", "0", "60"),
                                  ("d", "0", "60"), ("e", "0", "0"))]
  events = []
  sched = scheduler.Scheduler(2, ready=re.compile("^ready", re.M), label="test")
  sched.run(jobs[:2],
            on_launch=lambda j, c: events.append(("launch", j.name, c, time.time())),
            on_finish=lambda j, rc, s: events.append(("finish", j.name, rc, time.time())),
            poll_seconds=0.05)
  # b waits for a's "ready" line (>= 0.8 s after a starts), not for a to end.
  assert [e[:2] for e in events[:2]] == [("launch", "a"), ("launch", "b")]
  assert events[1][3] - events[0][3] >= 0.8
  assert sorted(e[1:3] for e in events if e[0] == "finish") == [("a", 0), ("b", 0)]
  log_a = (tmp_path / "a" / "log").read_text()
  assert log_a.startswith("=== test ") and "ready" in log_a
  if cpus >= 2:  # two slots, disjoint CPU sets
    sets = [e[2] for e in events if e[0] == "launch"]
    assert not set(sets[0]) & set(sets[1])
    assert str(sets[1]) in (tmp_path / "b" / "log").read_text()

  events.clear()
  timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
  timer.start()
  with pytest.raises(KeyboardInterrupt):
    scheduler.Scheduler(2, pin_cpus=False).run(
        jobs[2:], on_finish=lambda j, rc, s: events.append((j.name, rc, s)),
        on_interrupt=lambda n: events.append(("interrupt", n)), poll_seconds=0.05)
  timer.join()
  assert events[0] == ("interrupt", 2)
  finished = sorted(events[1:])
  assert [(name, rc) for name, rc, _ in finished] == [("c", -signal.SIGTERM),
                                                      ("d", -signal.SIGTERM)]
  assert all(secs < 30 for _, _, secs in finished)
  assert not (tmp_path / "e").exists()  # never launched
