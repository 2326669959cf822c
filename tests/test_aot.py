"""mtp_jax.aot without libtpu or the CUDA plugin (the main venv): target parsing and the entry
points' one-line errors. The XLA:TPU compiles themselves are tests/tpu (make test-tpu), the
XLA:GPU ones tests/gpu (make test-gpu-aot)."""

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
    ("gpu:h100", ("gpu", "h100:1x1x1")),  # partitions x hosts x GPUs per host
    ("gpu:h200:8", ("gpu", "h200:1x1x8")),
    ("gpu:h200:2x8", ("gpu", "h200:1x2x8")),
    ("gpu:h100:2x1x4", ("gpu", "h100:2x1x4")),
])
def test_parse_target(text, want):
  assert aot.parse_target(text) == want


@pytest.mark.parametrize("text", ["tpu", "tpu:v5e", "tpu:v5e:16x", "v5e:2x2", "gpu", "gpu:a100",
                                  "gpu:h100:0", "gpu:h100:", "gpu:h200:1x1x1x8", "gpu:h200:8x"])
def test_parse_target_refuses(text):
  with pytest.raises(ValueError, match=r"^--target: got .*allowed: cpu .*tpu:v5e:16x16.*"
                     r"gpu:h100\|h200\[:N\|HxN\|PxHxN\]"):
    aot.parse_target(text)


def test_prepare_env_for_a_gpu_target(monkeypatch):
  """No GPU seen, autotuning off (nothing to time kernels on), a caller's flags kept."""
  for k in ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS"):
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  aot.prepare_env(("gpu", "h100:1x1x1"))
  assert os.environ["CUDA_VISIBLE_DEVICES"] == "-1" and os.environ["JAX_PLATFORMS"] == "cpu"
  assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_autotune_level=0"
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=2")
  aot.prepare_env(("gpu", "h100:1x1x1"))
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=2"


def test_gpu_target_config_names_the_device():
  """The GpuTargetConfig text XLA:GPU compiles for: an H200 differs from XLA's H100 spec in
  its memory and bandwidth only."""
  h100, h200 = aot.gpu_target_config("h100"), aot.gpu_target_config("h200")
  assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in h100
  assert "core_count: 132" in h100 and "memory_bandwidth: 3352320000000" in h100
  assert "cuda_compute_capability { major: 9 minor: 0 }" in h100
  differ = sorted(set(h100.splitlines()) ^ set(h200.splitlines()))
  assert sorted(line.split(":")[0].strip() for line in differ) == [
      "device_description_str", "device_description_str", "device_memory_size",
      "device_memory_size", "memory_bandwidth", "memory_bandwidth"]
  assert aot.HBM_GIB["NVIDIA H200"] == 143771 / 1024


def test_prepare_env_keeps_what_the_caller_set(monkeypatch):
  for k in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_SKIP_MDS_QUERY",
            "ALLOW_MULTIPLE_LIBTPU_LOAD", "JAX_PLATFORMS"):
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
  aot.prepare_env(("tpu", "v5p:4x4x4"))
  assert os.environ["TPU_ACCELERATOR_TYPE"] == "v6e-8"
  assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"
  assert os.environ["JAX_PLATFORMS"] == "cpu"


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None
                    or importlib.util.find_spec("jax_cuda12_plugin") is not None,
                    reason="libtpu or the CUDA plugin installed")
@pytest.mark.parametrize("argv, want", [
    (["--target", "tpu:v5e:2x2"], "error: --target tpu:v5e:2x2: libtpu is not installed"),
    (["--target", "gpu:h200:8"],
     "error: --target gpu:h200:1x1x8: jax_cuda12_plugin is not installed; install "
     "\"jax[cuda12-local]=="),
    (["--target", "gpu:a100"], "error: --target: got 'gpu:a100', allowed: cpu"),
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


@pytest.mark.parametrize("target,mesh,want", [
    ("gpu:h200", "fsdp=8", "gpu:h200:8"), ("gpu:h200", "data=2,fsdp=8", "gpu:h200:2x8"),
    ("gpu:h100", "fsdp=4", "gpu:h100:4"), ("gpu:h200", "", "gpu:h200"),
    ("gpu:h200:8", "fsdp=4", "gpu:h200:8"), ("tpu:v5e:2x2", "fsdp=4", "tpu:v5e:2x2"),
    ("gpu:h200", "fsdp=-1", "gpu:h200")])
def test_plan_memory_sizes_a_gpu_target_by_the_mesh(target, mesh, want):
  """plan_memory --target gpu:h200 --mesh fsdp=8: the mesh's 8 GPUs, one HGX host."""
  from experiments.plan_memory import gpus_from_mesh
  assert gpus_from_mesh(target, mesh) == want


class _Compiled:
  def __init__(self, text):
    self._text = text

  def as_text(self):
    return self._text


GPU_HLO = """HloModule jit_f
%fused_computation (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %e = f32[8]{0} exponential(%p)
}

ENTRY %main (a: f32[8], b: f32[8]) -> (f32[8], f32[8]) {
  %a = f32[8]{0} parameter(0)
  %b = f32[8]{0} parameter(1)
  %fusion = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_computation
  %copy = f32[8]{0} copy(%b)
  %bitcast = f32[2,4]{1,0} bitcast(%fusion)
  %custom-call = (f32[8]{0}, s8[4]{0}) custom-call(%copy), custom_call_target="__cublas$gemm"
  %get-tuple-element = f32[8]{0} get-tuple-element(%custom-call), index=0
  ROOT %tuple = (f32[8]{0}, f32[8]{0}) tuple(%fusion, %get-tuple-element)
}
"""


def test_gpu_kernels_and_step_model():
  """The kernels of one call: the entry's fusions, copies and library calls, not its views,
  tuples or parameters, nor the ops inside a fused computation; a program with a while loop is
  refused (its body would run many times). The step model adds the launches to the bytes at
  the target's bandwidth."""
  assert aot.gpu_kernels(_Compiled(GPU_HLO)) == 3
  looped = GPU_HLO.replace("%copy = f32[8]{0} copy(%b)", "%copy = f32[8]{0} while(%b), "
                           "condition=%c, body=%d")
  with pytest.raises(ValueError, match="while loops"):
    aot.gpu_kernels(_Compiled(looped))
  kind, info = aot.GPUS["h100"]
  assert aot.gpu_step_seconds(10, info["memory_bandwidth"], kind, launch_seconds=1e-6) == (
      pytest.approx(1 + 10e-6))
