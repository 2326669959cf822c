"""XLA:GPU ahead of time on a CPU host with no GPU (needs the CUDA plugin and cuDNN: `make
test-gpu-aot` runs this directory in .venv-gpu; the main suite ignores it). Nothing runs on a
GPU: these check that the real GPU compiler takes the program, that attention_impl "auto" picks
the cuDNN flash kernel for a GPU target, and what the records say."""

from __future__ import annotations

import importlib.metadata
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bench_accel_on_sequential_workdir, plan_small_7b, require

from mtp_jax import aot, attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
require("jax_cuda12_plugin")
require("nvidia.cudnn")
aot.prepare_env(aot.parse_target("gpu:h100"))  # before any backend starts: no GPU, no autotuning


def test_train_step_compiles_for_h100_with_cudnn(tmp_path):
  """plan_memory --target gpu:h100:4 on a small 7B-shaped model: XLA:GPU compiles the whole
  train step (packed documents, grad_accum 2, full remat) for 4 abstract H100s, FSDP over them,
  and attention_impl "auto" became cuDNN flash attention, forward and backward."""
  assert jax.default_backend() == "cpu"  # no GPU here: the target decides the kernel
  out = tmp_path / "plan.json"
  assert plan_small_7b("gpu:h100:4", out) == 0
  saved = json.loads(out.read_text())
  if os.environ.get("GPU_AOT_JSON"):  # make test-gpu-aot keeps the record (docs/accelerators.md)
    with open(os.environ["GPU_AOT_JSON"], "w") as f:
      json.dump({**saved, "config": os.path.relpath(saved["config"], ROOT)}, f, indent=2)
  (r,) = saved["records"]
  assert (r["compiler"], r["device_kind"], r["devices"]) == ("XLA:GPU", "NVIDIA H100 80GB HBM3", 4)
  version = importlib.metadata.version("jax-cuda12-plugin")
  assert saved["compiler_version"] == r["compiler_version"] == f"jax-cuda12-plugin {version}"
  assert "not measured" in saved["what"]
  assert saved["device"]["sms"] == 132 and saved["device"]["cudnn"] == aot.cudnn_version()
  # 2 trunk blocks in one scan + 2 head blocks: fwd and bwd calls, each with the packed
  # documents' mask as a bias
  assert r["attention_impl"] == "auto" and r["cudnn_attention_calls"] >= 4
  # XLA:GPU gives no cost analysis: no time, and the record says so instead of a zero
  assert r["optimal_seconds"] is None and r["compiler_flops"] is None
  assert r["cost_analysis"] == aot.NO_COST_NOTE
  assert abs(r["hbm_gib"] - 84978434048 / 2**30) < 1e-9 and r["fits"]
  # memory_analysis is per GPU: this GPU's quarter of the state + its batch rows (4 KiB)
  assert r["state_bytes_per_device"] <= r["argument_bytes"] <= r["state_bytes_per_device"] + 65536
  assert r["alias_bytes"] > 0.9 * r["state_bytes_per_device"] and r["temp_bytes"] > 0


def _hlo(fn, *shapes):
  return jax.jit(fn).lower(*shapes).compile().as_text()


def test_auto_attention_is_cudnn_for_a_gpu_target():
  """attention.attend with "auto" under a mesh of one abstract H100 lowers to cuDNN's fused
  attention, forward and backward; packed documents go in as a bias (fmhaScaleBiasSoftmax);
  the decode path (a cache) and float32 go to xla, with no cuDNN call."""
  mesh = jax.sharding.Mesh(np.asarray(aot.target_devices(("gpu", "h100:1x1x1"))), ("data",))
  on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  B, S, H, K, E = 2, 256, 4, 2, 64
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=on)
  q, kv = spec((B, S, H, E)), spec((B, S, K, E))
  pos, seg = spec((B, S), jnp.int32), spec((B, S), jnp.int32)

  def loss(q, k, v, pos, seg=None, cached=False, dtype=jnp.bfloat16):
    out = attention.attend(q, k, v, pos, seg, cached=cached, impl="auto", dtype=dtype)
    return out.astype(jnp.float32).sum()

  grad = lambda **kw: jax.grad(lambda q, k, v, *a: loss(q, k, v, *a, **kw), argnums=(0, 1, 2))
  with jax.set_mesh(mesh):
    assert attention.resolve("auto", cached=False, segments=True, dtype=jnp.bfloat16) == "cudnn"
    plain = _hlo(grad(), q, kv, kv, pos)
    packed = _hlo(grad(), q, kv, kv, pos, seg)
    cached = _hlo(lambda *a: loss(*a, cached=True), q, kv, kv, pos)
    f32 = _hlo(lambda *a: loss(*a, dtype=jnp.float32), q, kv, kv, pos)
  calls = lambda text, name: text.count(f'custom_call_target="__cudnn${name}"')
  assert calls(plain, "fmhaSoftmax") == 1 and calls(plain, "fmhaSoftmaxBackward") == 1
  assert calls(packed, "fmhaScaleBiasSoftmax") == 1
  assert calls(packed, "fmhaScaleBiasSoftmaxBackward") == 1
  assert "__cudnn$fmha" not in cached and "__cudnn$fmha" not in f32


def test_memory_analysis_is_per_gpu_on_a_node():
  """A matmul sharded over 8 abstract H200s (gpu:h200:8): each GPU's argument is an eighth."""
  devices = aot.target_devices(aot.parse_target("gpu:h200:8"))
  assert len(devices) == 8 and devices[0].device_kind == "NVIDIA H200"
  assert aot.hbm_gib(devices[0]) == 143771 / 1024
  mesh = jax.sharding.Mesh(np.asarray(devices), ("fsdp",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  x = jax.ShapeDtypeStruct((8192, 1024), jnp.bfloat16, sharding=rows)
  compiled = jax.jit(lambda a: jnp.tanh(a) * 2).lower(x).compile()
  assert compiled.memory_analysis().argument_size_in_bytes == 8192 * 1024 * 2 // 8
  assert aot.compiler_name(devices[0]) == "XLA:GPU" and compiled.cost_analysis() is None


def test_aot_decode_gpu_model_on_a_workdirs_shape(tmp_path):
  """`bench_accel.py --target gpu:h100 --workdir W`: XLA:GPU compiles the two forwards with every
  scan unrolled; T1 and Tk are aot.gpu_step_seconds of their kernels and argument bytes (no
  compiler time on a GPU), and S = a x T1 / Tk."""
  rec = bench_accel_on_sequential_workdir("gpu:h100", tmp_path, 1.3)
  (r,) = rec["runs"]
  assert r["while_loops"] == 0 and r["kernels_k"] > r["kernels_1"] > 10
  assert r["T1_estimated"] == pytest.approx(aot.gpu_step_seconds(
      r["kernels_1"], r["argument_bytes_1"], "NVIDIA H100 80GB HBM3"))
  assert r["S_predicted"] == pytest.approx(1.3 * r["T1_estimated"] / r["Tk_estimated"])
  assert r["S_predicted_bandwidth_only"] == pytest.approx(
      1.3 * r["argument_bytes_1"] / r["argument_bytes_k"])
  assert "not the compiler's time" in rec["what"]
