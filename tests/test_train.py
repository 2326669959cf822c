"""Training end to end through the CLI, as a user runs it: exact resume, kill -9, SIGTERM,
corrupted checkpoints, non-finite steps, bad input. Tiny config (configs/tiny.py) on a small
text_folder corpus; subprocesses share a persistent compilation cache."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import copy_code_corpus, require, train_cmd

from mtp_jax import acceptance
from mtp_jax import optimizer as optim_lib
from mtp_jax import sharding as shard_lib
from mtp_jax import steps as steps_lib
from mtp_jax.model import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A few real Python files as a text_folder corpus, and a data dir shared by every run."""
  return copy_code_corpus(tmp_path_factory.mktemp("train_corpus"))


def env_for(corpus):
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=corpus["cache"],
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
  return env


def run_train(corpus, workdir, *overrides, check=True):
  p = subprocess.run(train_cmd(corpus, workdir, *overrides), env=env_for(corpus),
                     capture_output=True, text=True, timeout=600)
  if check and p.returncode != 0:
    raise AssertionError(f"train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
  return p


def summary(workdir):
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def batch_hashes(workdir) -> dict[int, str]:
  """step -> hash of the batch it trained on (a rerun step overwrites: the last one counts)."""
  out = {}
  with open(os.path.join(workdir, "batches.log")) as f:
    for line in f:
      step, h = line.split()
      out[int(step)] = h
  return out


def ckpt_steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit())


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
  """One uninterrupted 20-step run: the run every interrupted one must reproduce exactly."""
  wd = tmp_path_factory.mktemp("ref") / "run"
  p = run_train(corpus, wd)
  return {"workdir": wd, "summary": summary(wd), "stdout": p.stdout}


@pytest.mark.slow
def test_reference_run_outputs(reference):
  s, wd = reference["summary"], reference["workdir"]
  assert s["step"] == 20
  for key in ("train/loss", "eval/head1_loss", "eval/head2_acc", "eval/head2_agree",
              "tokens_per_sec", "wall_seconds", "params_sha256", "cpu", "cpu_cores"):
    assert key in s, key
  assert s["cpu"] and s["cpu_cores"] >= 1  # timings name the machine they come from
  assert np.isfinite(s["train/loss"])
  assert ckpt_steps(wd) == [10, 15, 20]  # keep_checkpoints = 3
  assert os.path.isfile(os.path.join(wd, "config.json"))
  assert any(n.startswith("events.out.tfevents") for n in os.listdir(wd))
  lines = open(os.path.join(wd, "metrics.jsonl")).read().splitlines()
  assert json.loads(lines[0])["step"] == 1
  assert "tok/s" in reference["stdout"] and "ETA" in reference["stdout"]
  # per-position acceptance in the evals, the a it estimates, and the run's PNG (2 evals)
  for mode in ("greedy", "sampled"):
    alpha = s[f"eval/head2_alpha_{mode}"]
    assert 0 <= alpha <= 1 and s[f"eval/head1_alpha_{mode}"] == 1.0
    est = acceptance.estimate(s, mode, "eval/")  # under either name
    assert est == pytest.approx(1 + alpha, abs=1e-4)  # n_future 2
    assert f"alpha {mode} [" in reference["stdout"]
  assert os.path.getsize(os.path.join(wd, "acceptance.png")) > 1000


_WRITER = """
import sys
from mtp_jax.metrics import MetricsWriter
w = MetricsWriter(sys.argv[1], total_steps=2, tokens_per_step=8)
w.write(1, "train", {"loss": 2.5, "tokens_per_sec": 100.0, "head_loss": [1.5, 1.0],
                     "head_acc": [0.25, 0.5]})
w.close()
assert "torch" not in sys.modules, "MetricsWriter imported torch"
import torch  # noqa: F401  (still importable afterwards)
"""


@pytest.mark.slow
def test_metrics_writer_keeps_torch_out_and_writes_tensorboard_scalars(tmp_path):
  """tensorboardX imports torch where it is installed (seconds at every run's start):
  MetricsWriter's import keeps it out, torch still imports afterwards, and the event file holds
  the scalars (TFRecord framing read here, Event protos parsed by tensorboardX's own)."""
  require("torch")
  p = subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path)], capture_output=True,
                     text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-3000:]
  from tensorboardX.proto import event_pb2
  (name,) = [n for n in os.listdir(tmp_path) if n.startswith("events.out.tfevents")]
  data, scalars = (tmp_path / name).read_bytes(), {}
  while data:  # [length u64][crc u32][record][crc u32]
    n = int.from_bytes(data[:8], "little")
    event = event_pb2.Event.FromString(data[12:12 + n])
    data = data[16 + n:]
    scalars.update({(v.tag, event.step): v.simple_value for v in event.summary.value})
  assert scalars[("train/loss", 1)] == 2.5 and scalars[("train/head2_acc", 1)] == 0.5, scalars


@pytest.mark.slow
def test_rerun_of_finished_run_keeps_summary(corpus, reference, tmp_path):
  """Rerunning a finished run (`make demo-scratch` twice) trains nothing and keeps every key and
  value of summary.json: the speed, eval and MFU of the steps that were trained."""
  wd = tmp_path / "run"
  shutil.copytree(reference["workdir"], wd)
  before = summary(wd)
  p = run_train(corpus, wd)
  assert "nothing to train" in p.stdout, p.stdout[-2000:]
  assert summary(wd) == before
  assert json.loads(p.stdout.strip().splitlines()[-1])["tokens_per_sec"] == before["tokens_per_sec"]


@pytest.mark.slow
def test_exact_resume_after_stop(corpus, reference, tmp_path):
  wd = tmp_path / "run"
  run_train(corpus, wd, "--config.train.stop_at=10")
  assert summary(wd)["step"] == 10
  # Resuming with another model (here a changed vocabulary padding) is refused in one line,
  # before the workdir's config.json is touched.
  saved = (wd / "config.json").read_bytes()
  p = run_train(corpus, wd, "--config.model.vocab_multiple=64", check=False)
  assert p.returncode == 2, p.stderr[-2000:]
  assert p.stderr.strip().startswith("error: config.model.vocab_multiple:"), p.stderr[-2000:]
  assert len(p.stderr.strip().splitlines()) == 1 and (wd / "config.json").read_bytes() == saved
  run_train(corpus, wd)
  assert summary(wd)["params_sha256"] == reference["summary"]["params_sha256"]
  assert batch_hashes(wd) == batch_hashes(reference["workdir"])


# Heavy tier: three training runs (~20 s), a resume repeat with the loss schedules on; the
# schedules' weights per step are tests/test_loss.py's, the exact resume is
# test_exact_resume_after_stop's.
@pytest.mark.heavy
@pytest.mark.slow
def test_loss_schedules_resume_exactly(corpus, tmp_path):
  """loss.mtp_lambda_schedule, loss.head_curriculum and a draft objective, stopped at step 10
  and resumed, end with the params of the straight run: the weights follow the train state's
  step (head 2 on at 4, head 3 at 8, lambda 0.3 -> 0.1 at 12, after the stop), and are logged
  per step (metrics.jsonl's step s: the weights of train step s - 1)."""
  args = ("--config.model.n_future=3", "--config.loss.head_weights=deepseek",
          "--config.loss.mtp_lambda_schedule=0.3@0,0.1@0.6", "--config.loss.head_curriculum=0.4",
          "--config.loss.draft_objective=tv")
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  run_train(corpus, straight, *args)
  run_train(corpus, resumed, *args, "--config.train.stop_at=10")
  run_train(corpus, resumed, *args)
  assert summary(resumed)["params_sha256"] == summary(straight)["params_sha256"]
  rows = [json.loads(l) for l in open(resumed / "metrics.jsonl")]
  weights = {r["step"]: [r.get(f"train/head{i}_weight") for i in (1, 2, 3)] for r in rows
             if "train/head1_weight" in r}
  for step, want in {1: [1, 0, 0], 5: [1, .15, 0], 9: [1, .15, .15], 12: [1, .15, .15],
                     13: [1, .05, .05], 20: [1, .05, .05]}.items():
    np.testing.assert_allclose(weights[step], want, rtol=1e-6, err_msg=str(step))
  assert 0 < summary(resumed)["train/head2_objective"] < 1  # tv: a probability


# Heavy tier: a fault repeat of test_exact_resume_after_stop's exact resume (a kill between saves)
@pytest.mark.heavy
@pytest.mark.slow
def test_kill_9_then_resume(corpus, reference, tmp_path):
  wd = tmp_path / "run"
  p = subprocess.Popen(train_cmd(corpus, wd, "--config.train.checkpoint_every=2"),
                       env=env_for(corpus), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while time.time() < deadline and p.poll() is None:
    if os.path.isdir(wd / "checkpoints") and any(s >= 4 for s in ckpt_steps(wd)):
      break
    time.sleep(0.05)
  p.send_signal(signal.SIGKILL)
  p.wait()
  assert not os.path.exists(wd / "summary.json"), "the run finished before it could be killed"
  run_train(corpus, wd, "--config.train.checkpoint_every=2")
  assert summary(wd)["params_sha256"] == reference["summary"]["params_sha256"]


# Heavy tier: a fault repeat of the exact resume above (the save on SIGTERM; ~25 s)
@pytest.mark.heavy
@pytest.mark.slow
def test_sigterm_saves_current_step_then_resumes_exactly(corpus, tmp_path):
  """SIGTERM mid-run saves the step it is at and exits 0; resumed to a later stop_at, the run
  ends with the params of one never interrupted. train.steps is large so the signal surely lands
  mid-run (the 20-step reference finishes in a fraction of a second once compiled); it sets the
  schedule, so the uninterrupted run here uses it too."""
  long = ("--config.train.steps=100000", "--config.train.checkpoint_every=100000")
  wd = tmp_path / "run"
  p = subprocess.Popen(train_cmd(corpus, wd, *long), env=env_for(corpus), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  metrics = wd / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
    time.sleep(0.05)
  p.send_signal(signal.SIGTERM)
  out, err = p.communicate(timeout=120)
  assert p.returncode == 0, err[-2000:]
  s = summary(wd)
  assert s["interrupted"] and 3 <= s["step"] < 100000
  assert ckpt_steps(wd) == [s["step"]]
  assert f"saved step {s['step']}" in out
  stop = f"--config.train.stop_at={s['step'] + 3}"
  run_train(corpus, wd, *long, stop)
  ref = tmp_path / "uninterrupted"
  run_train(corpus, ref, *long, stop)
  assert summary(wd)["step"] == summary(ref)["step"] == s["step"] + 3
  assert summary(wd)["params_sha256"] == summary(ref)["params_sha256"]
  assert batch_hashes(wd) == batch_hashes(ref)


@pytest.mark.slow  # truncate in the heavy tier (~9 s): the same fallback as an emptied step
@pytest.mark.parametrize("damage", ["empty", pytest.param("truncate", marks=pytest.mark.heavy)])
def test_corrupt_latest_falls_back(corpus, reference, tmp_path, damage):
  wd = tmp_path / "run"
  shutil.copytree(reference["workdir"], wd)
  latest = wd / "checkpoints" / "20"
  if damage == "empty":
    shutil.rmtree(latest)
    latest.mkdir()
  else:
    for dirpath, _, files in os.walk(latest / "state"):
      for name in files:
        path = os.path.join(dirpath, name)
        with open(path, "r+b") as f:
          f.truncate(os.path.getsize(path) // 2)
  os.remove(wd / "summary.json")  # the copied one must not pass for the resumed run's
  p = run_train(corpus, wd)
  assert "15" in p.stderr and "corrupt" in p.stderr.lower(), p.stderr[-2000:]
  assert any(n.startswith("corrupt-20") for n in os.listdir(wd / "checkpoints"))
  assert "resuming at step 15" in p.stdout
  # Steps 15-20 again from checkpoint 15: the params of the uninterrupted run.
  assert summary(wd)["step"] == 20
  assert summary(wd)["params_sha256"] == reference["summary"]["params_sha256"]


@pytest.mark.slow
def test_nonfinite_step_is_skipped_and_params_unchanged(corpus):
  from mtp_jax.config import load_file
  config = load_file(os.path.join(ROOT, "configs/tiny.py"))
  config.train.debug_nonfinite_steps = (0,)
  config.optim.warmup_steps = 0  # a skipped step does not advance the schedule: lr(0) must be > 0
  model = build_model(config)
  tx = optim_lib.make_optimizer(config)
  mesh = shard_lib.make_mesh(config)
  state = steps_lib.init_state(model, tx, config, mesh, jax.random.PRNGKey(0))
  before = jax.device_get(state.params)
  step = jax.jit(steps_lib.make_train_step(model, tx, config))
  batch = {"tokens": jnp.ones((4, 32), jnp.int32), "segment_ids": jnp.ones((4, 32), jnp.int32)}
  state, m = step(state, batch)
  assert int(m["nonfinite_total"]) == 1 and int(m["nonfinite_consecutive"]) == 1
  jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(state.params))
  state, m = step(state, batch)  # step 1 is clean: params move, the consecutive count resets
  assert int(m["nonfinite_total"]) == 1 and int(m["nonfinite_consecutive"]) == 0
  assert steps_lib.params_sha256(state.params) != steps_lib.params_sha256(before)


@pytest.mark.slow
def test_consecutive_nonfinite_stops_and_keeps_checkpoint(corpus, tmp_path):
  wd = tmp_path / "run"
  p = run_train(corpus, wd, "--config.train.debug_nonfinite_steps=(6, 7, 8, 9, 10, 11)",
                "--config.optim.max_consecutive_nonfinite=3", check=False)
  assert p.returncode == 3
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("error:") and "non-finite" in last
  assert ckpt_steps(wd) and max(ckpt_steps(wd)) <= 10
  assert not os.path.exists(wd / "summary.json")


# An unknown config field (a flag error) is test_cli.py's, in a real process too.
@pytest.mark.parametrize("overrides,needle", [
    (["--config.data.corpus=nope"], "config.data.corpus"),
    (["--config.data.seq_len=4096"], "config.data.seq_len"),
    (["--config.data.glob=*.nothing"], "config.data"),
])
def test_bad_input_one_line_error_and_workdir_untouched(corpus, tmp_path, overrides, needle):
  wd = tmp_path / "run"
  wd.mkdir()
  (wd / "keep.txt").write_text("precious")
  p = run_train(corpus, wd, *overrides, check=False)
  assert p.returncode != 0
  lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
  assert lines[-1].startswith("error:") and needle in lines[-1], p.stderr[-2000:]
  assert "Traceback" not in p.stderr
  assert sorted(os.listdir(wd)) == ["keep.txt"]


def test_missing_workdir_flag(corpus):
  cmd = train_cmd(corpus, "x")
  i = cmd.index("--workdir")
  del cmd[i:i + 2]
  p = subprocess.run(cmd, env=env_for(corpus), capture_output=True, text=True, timeout=120)
  assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: --workdir")


# Decoding from a trained workdir: the generate CLI and its input checks.

def generate_cmd(workdir, *args):
  return [sys.executable, "-m", "mtp_jax.generate", "--workdir", str(workdir), *args]


@pytest.mark.slow
def test_generate_cli_both_modes(corpus, reference):
  p = subprocess.run(generate_cmd(reference["workdir"], "--prompt", "def f(x):", "--prompt",
                                  "import os\n", "--max_new_tokens", "24", "--mode", "both",
                                  "--heads", "2"),
                     env=env_for(corpus), capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.count("--- prompt") == 2
  assert "speculative: tokens 48 forwards" in p.stdout and "greedy: tokens 48" in p.stdout
  assert "identical to greedy: True" in p.stdout


@pytest.mark.parametrize("texts,kw,needle", [
    ([""], {}, "--prompt: prompt 1 is empty"),
    ([], {}, "--prompt: give at least one"),
    (["x" * 120], {}, "max_new_tokens: prompt (120 tokens) + max_new_tokens"),
    (["ok \udc80"], {}, "cannot be encoded"),
    (["def"], {"heads": 3}, "k: must be between 1 and the model's n_future (2)"),
])
def test_generate_bad_input(reference, texts, kw, needle):
  """generate.run's errors name its parameters (the decoder's k for heads); the CLI maps them to
  flags (cli.flag_error, tests/test_cli.py)."""
  from mtp_jax import generate
  args = {"max_new_tokens": 16, "mode": "speculative", "heads": None, **kw}
  with pytest.raises(ValueError) as e:
    generate.run(str(reference["workdir"]), texts, **args)
  assert needle in str(e.value)


def test_generate_workdir_without_checkpoint(corpus, tmp_path):
  wd = tmp_path / "empty"
  wd.mkdir()
  p = subprocess.run(generate_cmd(wd, "--prompt", "x"), env=env_for(corpus),
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 2 and "Traceback" not in p.stderr
  assert p.stderr.strip().splitlines()[-1].startswith("error: --workdir")
  shutil.copy(os.path.join(ROOT, "configs/tiny.py"), wd / "config.py")
  (wd / "config.json").write_text(json.dumps({"model": {"n_future": 2}}))
  from mtp_jax import generate
  with pytest.raises(ValueError, match="no checkpoint"):
    generate.run(str(wd), ["x"], max_new_tokens=4, mode="greedy", heads=None)


# Heavy tier: one more training run (~13 s), from a relative workdir; the checkpoint commit
# itself is every resume test's in make test.
@pytest.mark.heavy
@pytest.mark.slow
def test_relative_workdir_checkpoints_commit(corpus, tmp_path):
  """orbax refuses relative paths only in its background commit: a run must still checkpoint."""
  cmd = train_cmd(corpus, "rel/run", "--config.train.steps=5")
  p = subprocess.run(cmd, env=env_for(corpus), cwd=tmp_path, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert ckpt_steps(tmp_path / "rel" / "run") == [5]
