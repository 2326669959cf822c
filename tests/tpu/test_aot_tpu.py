"""XLA:TPU ahead of time on a CPU host (needs libtpu: `make test-tpu` runs this directory in
.venv-tpu; the main suite ignores it). Nothing runs on a TPU: these check that the real TPU
compiler takes the program, what it picked, and the compiler's own numbers."""

from __future__ import annotations

import importlib.metadata
import json

import jax
import jax.numpy as jnp
import numpy as np
from conftest import plan_small_7b, require

from mtp_jax import aot

TARGET = aot.parse_target("tpu:v5e:2x2")
require("libtpu")
aot.prepare_env(TARGET)  # before libtpu starts (at the first topology): no TPU VM discovery


def test_train_step_compiles_for_v5e_with_splash(tmp_path):
  """plan_memory --target tpu:v5e:2x2 on a small 7B-shaped model: XLA:TPU compiles the whole
  train step for 4 abstract v5e chips (FSDP over them), and attention_impl "auto" resolved to
  the Pallas splash kernel, lowered by Mosaic, shard_mapped over the batch."""
  assert jax.default_backend() == "cpu"  # no chip here: the target decides the kernel
  out = tmp_path / "plan.json"
  assert plan_small_7b("tpu:v5e:2x2", out, "--cost", "none") == 0
  saved = json.loads(out.read_text())
  (r,) = saved["records"]
  assert (r["compiler"], r["device_kind"], r["devices"]) == ("XLA:TPU", "TPU v5 lite", 4)
  # the JSON names the compiler that made its figures, and that they are not measurements
  version = importlib.metadata.version("libtpu")
  assert saved["compiler_version"] == r["compiler_version"] == f"libtpu {version}"
  assert "not measured" in saved["what"]
  assert r["attention_impl"] == "auto" and r["mosaic_kernel_calls"] > 0
  assert r["hbm_gib"] == 16.0 and r["fits"]
  # memory_analysis is per chip: the arguments are this chip's quarter of the state + its batch
  # rows (4 KiB here), in XLA:TPU's tiled layouts (a few KiB of padding: 12.5 KiB over, seen)
  assert r["state_bytes_per_device"] <= r["argument_bytes"] <= r["state_bytes_per_device"] + 65536
  assert r["alias_bytes"] > 0.9 * r["state_bytes_per_device"] and r["temp_bytes"] > 0
  assert r["optimal_seconds_loops_once"] > 0  # XLA:TPU gives a time (XLA:CPU does not)


def test_cost_analysis_counts_a_loop_body_once_unless_unrolled():
  """The trap aot.unrolled_scans works around: 8 scanned matmuls cost one in cost_analysis."""
  devices = aot.target_devices(TARGET)
  x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16,
                           sharding=jax.sharding.SingleDeviceSharding(devices[0]))
  f = lambda a: jax.lax.scan(lambda c, _: (jnp.tanh(c @ c), None), a, None, length=8)[0]
  looped = jax.jit(f).lower(x).compile()
  with aot.unrolled_scans():
    unrolled = jax.jit(lambda a: f(a)).lower(x).compile()  # a new function: traced again
  assert jax.lax.scan is not None and aot.while_loops(looped) == 1
  assert aot.while_loops(unrolled) == 0
  flops = lambda c: aot.cost_record(c, devices[0], "bfloat16", None)["compiler_flops"]
  np.testing.assert_allclose(flops(looped), 2 * 1024**3, rtol=0.01)
  np.testing.assert_allclose(flops(unrolled), 8 * 2 * 1024**3, rtol=0.01)
  seconds = lambda c: aot.cost_record(c, devices[0], "bfloat16", None)["optimal_seconds"]
  at_peak = 8 * 2 * 1024**3 / 197e12  # 8 matmuls at v5e's peak: 87 us
  assert at_peak <= seconds(unrolled) < 2 * at_peak  # 99 us seen
  assert seconds(looped) < at_peak / 2  # 39 us seen: one matmul and the loop
