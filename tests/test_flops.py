"""FLOPs per token against counts worked by hand, against the real model's parameter shapes, the
peak table and MFU, and bench_accel end to end at its tiny size."""

from __future__ import annotations

import json
import os
import types

import jax
import pytest
from conftest import tiny_config

from mtp_jax import flops
from mtp_jax.model import build_model, init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tiny_config: vocab 61, d_model 32, 4 layers, 4 attention heads of size 8 (2 kv heads), d_ff 64,
# seq_len 16. Per token, forward, 2 FLOPs per multiply-add:
Q = O = 2 * 32 * 32  # wq, wo
K_ = V_ = 2 * 32 * (2 * 8)  # wk, wv: 2 kv heads of size 8
MLP = 3 * (2 * 32 * 64)  # SwiGLU w1, w3, w2
BLOCK = Q + K_ + V_ + O + MLP
ATTN = 4 * (2 * 8 * 16 + 2 * 8 * 16)  # 4 heads x (q.k over 16 keys + p.v over 16 values)
UNEMBED = 2 * 32 * 61


def forward(c, **kw):
  return flops.flops_per_token(c, train=False, **kw)


def test_block_by_hand():
  assert (BLOCK, ATTN, UNEMBED) == (18432, 2048, 3904)


def test_parallel_hand_count():
  """Gloeckle et al. 2024 §2: n=2 takes 2 of the 4 layers as head blocks; 2 unembeddings."""
  f = forward(tiny_config("parallel", 2))
  assert f["trunk"] == 2 * BLOCK
  assert f["heads"] == 2 * BLOCK
  assert f["attention"] == 4 * ATTN
  assert f["unembedding"] == 2 * UNEMBED
  assert f["total"] == 4 * BLOCK + 4 * ATTN + 2 * UNEMBED == 89728


def test_projection_hand_count():
  """n=3: 4 trunk blocks, 2 residual MLPs 32 -> 64 -> 32 (no attention), 3 unembeddings."""
  f = forward(tiny_config("projection", 3))
  mlp_head = 2 * 32 * 64 + 2 * 64 * 32
  assert f["trunk"] == 4 * BLOCK
  assert f["heads"] == 2 * mlp_head
  assert f["attention"] == 4 * ATTN
  assert f["unembedding"] == 3 * UNEMBED
  assert f["total"] == 4 * BLOCK + 2 * mlp_head + 4 * ATTN + 3 * UNEMBED == 110016


def test_sequential_hand_count():
  """DeepSeek-V3 eq. 21-23, n=3: 4 trunk blocks, 2 depths of eh_proj 64 -> 32 and a block."""
  f = forward(tiny_config("sequential", 3))
  depth = 2 * 64 * 32 + BLOCK
  assert f["trunk"] == 4 * BLOCK
  assert f["heads"] == 2 * depth
  assert f["attention"] == 6 * ATTN
  assert f["unembedding"] == 3 * UNEMBED
  assert f["total"] == 4 * BLOCK + 2 * depth + 6 * ATTN + 3 * UNEMBED == 142784


@pytest.mark.parametrize("kind", ["parallel", "projection", "sequential"])
def test_n1_is_a_next_token_transformer(kind):
  """n_future=1 of every kind is a plain 4-layer transformer with one unembedding."""
  plain = 4 * BLOCK + 4 * ATTN + UNEMBED
  assert forward(tiny_config(kind, 1))["total"] == plain == 85824


@pytest.mark.parametrize("kind,n", [("parallel", 4), ("projection", 3), ("sequential", 2)])
def test_train_is_three_forwards(kind, n):
  c = tiny_config(kind, n)
  fwd, train = forward(c), flops.flops_per_token(c)
  assert train == {k: 3 * v for k, v in fwd.items()}


def _heads_only(c):
  c.optim.trainable = "heads"
  return flops.flops_per_token(c)


def test_heads_only_parallel_hand_count():
  """optim.trainable = "heads", parallel n=2: the 2 trunk blocks and head 1's block forward only
  (frozen: no weight gradient, and no input gradient, nothing below them trains), head 2's block
  and its attention x3, head 1's logits forward only, head 2's forward + input gradient (the
  frozen unembedding gets no weight gradient)."""
  f = _heads_only(tiny_config("parallel", 2))
  assert f["trunk"] == 2 * BLOCK
  assert f["heads"] == BLOCK + 3 * BLOCK
  assert f["attention"] == (2 + 1) * ATTN + 3 * ATTN
  assert f["unembedding"] == UNEMBED + 2 * UNEMBED
  assert f["total"] == 6 * BLOCK + 6 * ATTN + 3 * UNEMBED == 134592
  assert flops.flops_per_token(tiny_config("parallel", 2))["total"] == 3 * 89728  # "all"


def test_heads_only_projection_hand_count():
  """Projection n=3: head 1 has no weights of its own; the 2 residual MLPs x3, the trunk and
  its attention forward only, 1 + 2 * 2 unembedding passes."""
  f = _heads_only(tiny_config("projection", 3))
  mlp_head = 2 * 32 * 64 + 2 * 64 * 32
  assert (f["trunk"], f["heads"], f["attention"]) == (4 * BLOCK, 3 * 2 * mlp_head, 4 * ATTN)
  assert f["unembedding"] == 5 * UNEMBED
  assert f["total"] == 150592
  assert _heads_only(tiny_config("sequential", 1)) == forward(tiny_config("sequential", 1))


def test_causal_half_halves_attention_only():
  c = tiny_config("sequential", 3)
  full, half = forward(c), forward(c, causal_half=True)
  assert half["attention"] == full["attention"] / 2
  assert half["total"] == full["total"] - full["attention"] / 2


@pytest.mark.parametrize("kind", ["parallel", "projection", "sequential"])
def test_matmul_flops_are_twice_the_weights_used_per_token(kind):
  """The count read from the config against the real model's parameter shapes: every kernel is
  used once per token, the (tied) embedding once per head as the unembedding, its real rows
  (model.vocab_multiple's pad rows are no model FLOPs); norms are free."""
  c = tiny_config(kind, 3)
  shapes = jax.eval_shape(lambda: init_params(build_model(c), jax.random.PRNGKey(0)))
  leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
  kernels = sum(s.size for p, s in leaves if p[-1].key == "kernel")
  embedding = shapes["embed"]["embedding"].size
  assert embedding == 128 * c.model.d_model  # padded: 61 ids take 128 rows
  embedding = c.model.vocab_size * c.model.d_model
  f = forward(c)
  assert f["trunk"] + f["heads"] + f["unembedding"] == 2 * (kernels + 3 * embedding)


def test_mfu_and_peaks():
  assert flops.mfu(1000.0, 6e9, 1e13, 2) == pytest.approx(0.3)
  assert flops.mfu(1000.0, 6e9, None) is None
  h200 = types.SimpleNamespace(device_kind="NVIDIA H200", platform="gpu")
  assert flops.peak_flops_per_device("bfloat16", h200)[0] == pytest.approx(989.4e12)
  assert flops.peak_flops_per_device("float32", h200)[0] == pytest.approx(494.7e12)
  v5e = types.SimpleNamespace(device_kind="TPU v5 lite", platform="tpu")
  value, source = flops.peak_flops_per_device(jax.numpy.bfloat16, v5e)
  assert value == 197e12 and "v5e" in source
  with pytest.raises(ValueError, match=r"^dtype: got 'float16', allowed: 'float32', 'bfloat16'$"):
    flops.peak_flops_per_device("float16", h200)


def test_cpu_peak_is_measured_once():
  cpu = jax.devices("cpu")[0]
  value, source = flops.peak_flops_per_device("float32", cpu)
  assert 1e8 < value < 1e14 and "measured" in source and "1024x1024" in source
  assert flops.peak_flops_per_device("float32", cpu)[0] == value  # cached, not re-measured


# Heavy tier: a timing script's smoke (~25 s); the FLOP counts it uses are hand-checked above.
@pytest.mark.heavy
@pytest.mark.slow
def test_bench_accel_tiny(capsys):
  """bench_accel's main at its tiny size, 2 steps: the JSON it prints carries every figure."""
  from experiments import bench_accel
  rec = bench_accel.main(["--size", "tiny", "--steps", "2", "--warmup", "0",
                          "--max_new_tokens", "6", "--decode_reps", "1"])
  assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(rec))
  assert rec["platform"] == "cpu" and rec["batch"] == 2 and rec["seq_len"] == 32
  assert [r["n_future"] for r in rec["train"]] == [1, 4]
  assert rec["train"][0]["params"] == rec["train"][1]["params"]  # matched (parallel heads)
  for r in rec["train"]:
    assert r["tokens_per_second"] > 0 and 0 < r["mfu"] < 1 and r["peak_bytes"] > 0
    assert r["train_flops_per_token"]["total"] > 0
  assert rec["step_ratio_n4_over_n1"] == pytest.approx(
      rec["train"][1]["step_seconds_median"] / rec["train"][0]["step_seconds_median"])
  assert [d["batch"] for d in rec["decode"]["runs"]] == [1, 8]
  for d in rec["decode"]["runs"]:
    assert d["k"] == 4 and d["T1"] > 0 and d["Tc"] > 0 and d["a"] >= 1
    assert d["forward_1_seconds"] > 0 and d["forward_k_seconds"] > 0
    assert d["S_predicted"] == pytest.approx(
        d["a_batch"] * d["forward_1_seconds"] / d["forward_k_seconds"])
    assert d["identical"]
  assert "random-init" in rec["decode"]["params_from"]


# Heavy tier: the timing script's batch search (~15 s); its FLOP counts are hand-checked above.
@pytest.mark.heavy
@pytest.mark.slow
def test_bench_accel_fit_batch(monkeypatch):
  """--batch auto: the search over powers of two, and the compiled peak it reads (from shapes
  alone) grows with the batch."""
  from experiments import bench_accel
  make = lambda b: bench_accel.make_config("tiny", 4, "float32", b, [])
  small, big = bench_accel.compiled_peak(make(1)), bench_accel.compiled_peak(make(8))
  assert 0 < small < big
  per_row = lambda c: 1000 * c.train.batch_size  # a stand-in peak: 1000 bytes per row
  monkeypatch.setattr(bench_accel, "compiled_peak", per_row)
  assert bench_accel.fit_batch(make, 2, 8500) == 8  # doubles while it fits
  assert bench_accel.fit_batch(make, 32, 8500) == 8  # halves until it fits
  with pytest.raises(ValueError, match="^--batch: even batch 1 needs more than"):
    bench_accel.fit_batch(make, 4, 500)
