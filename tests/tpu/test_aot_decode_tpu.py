"""experiments/aot_decode.py (what `bench_accel.py --target tpu:...` runs) on bench_accel's tiny
size, XLA:TPU ahead of time (libtpu: `make test-tpu`): T1 and Tk of one abstract v5e chip, and the
speed-up they predict with a_batch read from a bench_decode-shaped JSON. ~3 s on 2 cores."""

from __future__ import annotations

import json
import os

import pytest
from conftest import REPO, bench_accel_on_sequential_workdir, require

from mtp_jax import aot

require("libtpu")
aot.prepare_env(aot.parse_target("tpu:v5e:2x2"))  # before libtpu starts

from experiments import aot_decode, bench_accel  # noqa: E402


def test_aot_decode_tiny_batch_1(tmp_path, monkeypatch):
  monkeypatch.setattr(aot_decode, "BATCHES", (1,))  # batch 8 compiles as long again
  acc = tmp_path / "bench_decode.json"
  acc.write_text(json.dumps([{"batch": 1, "heads": 4, "prompt_len": 16, "mode": "greedy",
                              "a": 2.0, "a_batch": 1.5, "step": 7}]))
  make = lambda size, n, dtype, batch: bench_accel.make_config(size, n, dtype, batch, [])
  rec = aot_decode.estimate("tpu:v5e:2x2", ["tiny"], make, bench_accel.K, "bfloat16", 16,
                            str(acc), 16)
  assert (rec["compiler"], rec["device_kind"], rec["dtype"]) == (
      "XLA:TPU", "TPU v5 lite", "bfloat16")
  assert "not a measurement" in rec["what"] and "step 7" in rec["acceptance_note"]
  (r,) = rec["runs"]
  assert (r["size"], r["batch"], r["k"], r["context"], r["while_loops"]) == ("tiny", 1, 4, 16, 0)
  assert r["a_batch_measured_on_cpu"] == 1.5
  assert r["S_predicted"] == pytest.approx(1.5 * r["T1_estimated"] / r["Tk_estimated"])
  # the figures docs/accelerators_tpu.md's table quotes (aot_decode_v5e_tiny.json, batch 1)
  with open(os.path.join(REPO, "experiments", "results", "aot_decode_v5e_tiny.json")) as f:
    kept = json.load(f)["runs"][0]
  assert kept["batch"] == 1
  for key in ("T1_estimated", "Tk_estimated", "compiler_flops_1", "compiler_flops_k"):
    assert r[key] == pytest.approx(kept[key], rel=0.05), key


def test_aot_decode_on_a_workdirs_shape(tmp_path):
  """`bench_accel.py --target tpu:... --workdir W`: the estimate on W's own shape and head kind
  (sequential heads here, as SmolLM2's in docs/smollm2_heads.md), a read from its grid."""
  rec = bench_accel_on_sequential_workdir("tpu:v5e:2x2", tmp_path, 1.3)
  wd = tmp_path / "seq_wd"
  (r,) = rec["runs"]
  assert r["size"] == "seq_wd" and rec["workdir"] == str(wd) and rec["dtype"] == "bfloat16"
  assert r["Tk_estimated"] > r["T1_estimated"] > 0
  assert r["S_predicted"] == pytest.approx(1.3 * r["T1_estimated"] / r["Tk_estimated"])
  with pytest.raises(ValueError, match="--workdir: .* is not a workdir"):
    bench_accel.main(["--target", "tpu:v5e:2x2", "--workdir", str(tmp_path)])
