"""mtp_jax.aot without libtpu (the main venv): target parsing and the entry points' one-line
errors. The XLA:TPU compiles themselves are tests/tpu (make test-tpu)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from mtp_jax import aot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("text, want", [
    ("cpu", ("cpu", None)),
    ("tpu:v5e:16x16", ("tpu", "v5e:16x16")),
    ("tpu:v5p:4x4x4", ("tpu", "v5p:4x4x4")),
])
def test_parse_target(text, want):
  assert aot.parse_target(text) == want


@pytest.mark.parametrize("text", ["tpu", "tpu:v5e", "gpu:h100", "tpu:v5e:16x", "v5e:2x2"])
def test_parse_target_refuses(text):
  with pytest.raises(ValueError, match=r"^--target: got .*allowed: cpu .*tpu:v5e:16x16"):
    aot.parse_target(text)


def test_prepare_env_keeps_what_the_caller_set(monkeypatch):
  for k in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_SKIP_MDS_QUERY",
            "ALLOW_MULTIPLE_LIBTPU_LOAD", "JAX_PLATFORMS"):
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
  aot.prepare_env(("tpu", "v5p:4x4x4"))
  assert os.environ["TPU_ACCELERATOR_TYPE"] == "v6e-8"
  assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"
  assert os.environ["JAX_PLATFORMS"] == "cpu"


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu installed")
@pytest.mark.parametrize("argv, want", [
    (["--target", "tpu:v5e:2x2"], "error: --target tpu:v5e:2x2: libtpu is not installed"),
    (["--target", "tpu:v5e"], "error: --target: got 'tpu:v5e', allowed: cpu"),
    ([], "error: --devices: must be >= 1"),
])
def test_plan_memory_target_errors(argv, want):
  proc = subprocess.run(
      [sys.executable, "experiments/plan_memory.py", "--config", "configs/paper_7b_n4.py",
       *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].startswith(want), proc.stderr[-2000:]
