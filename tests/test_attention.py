"""Every attention kernel the CPU can run equals the einsum reference (values and gradients,
f32), with packed segments and with the KV cache; `auto` and the fallbacks pick what they say."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_params, tiny_config
from mtp_jax import attention
from mtp_jax import loss as loss_lib
from mtp_jax.model import MTPModel, build_model

B, H, K, E = 2, 4, 2, 8


def _qkv(S, T, seed=0):
  r = np.random.default_rng(seed)
  draw = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  return draw(B, S, H, E), draw(B, T, K, E), draw(B, T, K, E)


def _packed(S):
  """Row 0: documents 1, 2 and padding (0); row 1: a single document."""
  a = np.r_[np.full(S // 3, 1), np.full(S // 2, 2), np.zeros(S - S // 3 - S // 2)]
  return jnp.asarray(np.stack([a, np.ones(S)]), jnp.int32)


def _value_and_grads(fn, q, k, v):
  w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)  # a generic cotangent
  return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2))(
      q, k, v)

IMPLS = {
    "cpu": functools.partial(attention.cpu_attention, dtype=jnp.float32),
    "cpu_1_block": functools.partial(attention.cpu_attention, dtype=jnp.float32,
                                     query_blocks=1),
    "cpu_4_blocks": functools.partial(attention.cpu_attention, dtype=jnp.float32,
                                      query_blocks=4),
    "xla": functools.partial(attention.xla_attention, implementation="xla"),
}


@pytest.mark.slow
@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("packed", [False, True])
def test_training_path_equals_reference(impl, packed):
  S = 24
  q, k, v = _qkv(S, S)
  pos = jnp.broadcast_to(jnp.arange(S), (B, S))
  seg = _packed(S) if packed else None
  ref = functools.partial(attention.einsum_attention, positions_BxS=pos, segment_ids_BxS=seg,
                          cached=False, dtype=jnp.float32)
  fn = functools.partial(IMPLS[impl], positions_BxS=pos, segment_ids_BxS=seg, cached=False)
  np.testing.assert_allclose(fn(q, k, v), ref(q, k, v), rtol=1e-5, atol=1e-6)
  got, want = _value_and_grads(fn, q, k, v), _value_and_grads(ref, q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["cpu", "xla"])
def test_cache_path_equals_reference(impl):
  """A 3-query verification window at per-row positions against a 20-slot cache whose slots
  past each row's window hold stale values that must stay unread."""
  q, k, v = _qkv(3, 20, seed=1)
  pos = jnp.asarray([[4, 5, 6], [11, 12, 13]], jnp.int32)
  ref = functools.partial(attention.einsum_attention, positions_BxS=pos, segment_ids_BxS=None,
                          cached=True, dtype=jnp.float32)
  fn = functools.partial(IMPLS[impl], positions_BxS=pos, segment_ids_BxS=None, cached=True)
  got, want = _value_and_grads(fn, q, k, v), _value_and_grads(ref, q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-5)
  np.testing.assert_allclose(fn(q, k.at[:, 14:].set(1e3), v.at[:, 14:].set(1e3)), fn(q, k, v),
                             rtol=1e-6)


@pytest.mark.parametrize("impl", ["cpu", "xla", "einsum"])
def test_heads_major_cache_equals_cache_as_given(impl):
  """The KV cache is stored [B, K, T, E] (layers.init_cache): attend(kv_heads_major=True) on the
  transposed cache gives what the [B, T, K, E] call gives, values and gradients."""
  q, k, v = _qkv(3, 20, seed=1)
  pos = jnp.asarray([[4, 5, 6], [11, 12, 13]], jnp.int32)
  hm = lambda x: x.transpose(0, 2, 1, 3)
  def call(major):
    return lambda q, k, v: attention.attend(q, hm(k) if major else k, hm(v) if major else v,
                                            pos, cached=True, impl=impl, kv_heads_major=major)
  got, want = _value_and_grads(call(True), q, k, v), _value_and_grads(call(False), q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)


@pytest.mark.slow
def test_splash_kernel_in_interpret_mode_equals_reference():
  """The TPU kernel's wiring (head layout, scale, causal block mask, segment ids) run by the
  Pallas interpreter on the CPU; its tiles are 128 wide, so S = 128."""
  S = 128
  q, k, v = _qkv(S, S, seed=2)
  q, k, v = q[:1], k[:1], v[:1]
  pos = jnp.arange(S)[None]
  seg = _packed(S)[:1]
  ref = functools.partial(attention.einsum_attention, positions_BxS=pos, segment_ids_BxS=seg,
                          cached=False, dtype=jnp.float32)
  fn = functools.partial(attention.splash_attention, positions_BxS=pos, segment_ids_BxS=seg,
                         interpret=True)
  got, want = _value_and_grads(fn, q, k, v), _value_and_grads(ref, q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("impl, backend, cached, segments, dtype, want", [
    ("auto", "cpu", False, False, jnp.float32, "cpu"),
    ("auto", "gpu", False, False, jnp.bfloat16, "cudnn"),
    ("auto", "gpu", False, False, jnp.float32, "xla"),  # cudnn flash attention is 16-bit only
    ("auto", "gpu", False, True, jnp.bfloat16, "cudnn"),  # packed documents: a bias
    ("auto", "gpu", True, False, jnp.bfloat16, "xla"),
    ("auto", "tpu", False, True, jnp.float32, "splash"),
    ("auto", "tpu", True, False, jnp.float32, "xla"),
    ("cudnn", "cpu", False, False, jnp.bfloat16, "cpu"),
    ("splash", "cpu", False, False, jnp.float32, "cpu"),
    ("einsum", "tpu", True, True, jnp.float32, "einsum"),
    ("xla", "cpu", True, True, jnp.float32, "xla"),
])
def test_resolve_picks_and_falls_back(impl, backend, cached, segments, dtype, want):
  assert attention.resolve(impl, cached=cached, segments=segments, dtype=dtype,
                           backend=backend) == want


def test_fallback_reason_logged_once(caplog):
  attention._logged.clear()
  with caplog.at_level(logging.WARNING, logger="mtp_jax.attention"):
    for _ in range(3):
      attention.resolve("splash", cached=True, segments=False, dtype=jnp.float32,
                        backend="tpu")
  msgs = [r.getMessage() for r in caplog.records]
  assert msgs == ["attention_impl='splash': splash has no per-row cache positions (the decode "
                  "path); using 'xla'"]


@pytest.mark.slow
def test_model_default_impl_equals_einsum_with_packed_documents():
  """The whole model (trunk + parallel head blocks) and its loss gradients under `auto` (the
  cpu kernel here) against the einsum reference, on a packed batch with padding."""
  c = tiny_config("parallel", n_future=2)
  model = build_model(c)
  assert model.args.attention_impl == "auto"
  params = random_params(model)
  S = c.data.seq_len
  r = np.random.default_rng(0)
  batch = {"tokens": jnp.asarray(r.integers(0, 61, (B, S)), jnp.int32),
           "segment_ids": _packed(S)}
  out = {}
  for impl in ("einsum", "auto"):
    m = MTPModel(dataclasses.replace(model.args, attention_impl=impl))
    fn = lambda p, m=m: loss_lib.model_loss(p, m, c, batch)[0]
    out[impl] = jax.value_and_grad(fn)(params)
  for g, w in zip(jax.tree.leaves(out["auto"]), jax.tree.leaves(out["einsum"])):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
