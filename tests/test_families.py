"""Model-family features (model.qkv_bias, qk_norm, head_dim, rope_scaling, sliding_window): RoPE
frequencies equal transformers', the sliding-window mask by hand, every attention kernel with a
window equal to the reference, and the KV-cache path equal to the no-cache forward with every
feature on. The whole-model equality with transformers' Llama / Qwen2 / Qwen3 / Mistral is in
tests/test_convert_families.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require, tiny_config, tiny_model
from mtp_jax import attention, flops
from mtp_jax.config import validation
from mtp_jax.layers import rope_frequencies
from mtp_jax.model import init_decode_cache, model_args

ROPES = {  # ours -> transformers' rope_parameters
    "linear": dict(rope_factor=4.0),
    "llama3": dict(rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                   rope_original_max_len=64),
    "yarn": dict(rope_factor=4.0, rope_original_max_len=64, rope_beta_fast=32.0,
                 rope_beta_slow=1.0),
}


def _hf_params(kind, fields, theta):
  p = {"rope_type": kind, "rope_theta": theta, "factor": fields["rope_factor"]}
  if kind == "llama3":
    p.update(low_freq_factor=fields["rope_low_freq_factor"],
             high_freq_factor=fields["rope_high_freq_factor"])
  if kind in ("llama3", "yarn"):
    p["original_max_position_embeddings"] = fields["rope_original_max_len"]
  if kind == "yarn":
    p.update(beta_fast=fields["rope_beta_fast"], beta_slow=fields["rope_beta_slow"])
  return p


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rope_frequencies_equal_transformers(kind):
  require("torch")
  transformers = require("transformers")
  rope_init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS
  c = tiny_config()
  c.model.rope_theta, c.model.head_dim, c.model.rope_scaling = 50000.0, 16, kind
  c.model.max_len = 256
  for k, v in ROPES[kind].items():
    setattr(c.model, k, v)
  validation.validate(c)
  inv, factor = rope_frequencies(model_args(c))
  hf = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=16,
                                max_position_embeddings=256,
                                rope_parameters=_hf_params(kind, ROPES[kind], 50000.0))
  want, want_factor = rope_init[kind](hf, "cpu")
  np.testing.assert_allclose(inv, want.numpy(), rtol=1e-6)
  assert factor == pytest.approx(want_factor)
  if kind != "linear":  # the scaling changes some frequencies and keeps others
    plain, _ = rope_frequencies(model_args(tiny_config()).__class__(
        **{**model_args(c).__dict__, "rope_scaling": "none"}))
    assert (inv != plain).any() and (inv == plain).any()


def test_sliding_window_mask_by_hand():
  """Window 3 over positions 0..5: query t sees keys t-2..t; in a second segment only its own."""
  visible = attention._visible_BxSxT
  pos = jnp.arange(6)[None]
  got = np.asarray(visible(pos, None, 6, False, window=3)[0])
  want = np.array([[1, 0, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0, 0],
                   [1, 1, 1, 0, 0, 0],
                   [0, 1, 1, 1, 0, 0],
                   [0, 0, 1, 1, 1, 0],
                   [0, 0, 0, 1, 1, 1]], bool)
  np.testing.assert_array_equal(got, want)
  seg = jnp.asarray([[1, 1, 1, 1, 2, 2]])
  got = np.asarray(visible(pos, seg, 6, False, window=3)[0])
  want[4:, :4] = False
  np.testing.assert_array_equal(got, want)
  # the cache: query at position 4 sees slots 2, 3, 4 of an 8-slot cache
  got = np.asarray(visible(jnp.asarray([[4]]), None, 8, True, window=3))
  np.testing.assert_array_equal(got[0, 0], [0, 0, 1, 1, 1, 0, 0, 0])


B, H, K, E, W = 2, 4, 2, 8, 5


def _qkv(S, T, seed=0):
  r = np.random.default_rng(seed)
  draw = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  return draw(B, S, H, E), draw(B, T, K, E), draw(B, T, K, E)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["cpu", "cpu_4", "xla", "splash"])
def test_window_kernels_equal_reference(impl):
  S = 128 if impl == "splash" else 24
  q, k, v = _qkv(S, S)
  if impl == "splash":
    q, k, v = q[:1], k[:1], v[:1]
  pos = jnp.broadcast_to(jnp.arange(S), (q.shape[0], S))
  seg = None if impl == "splash" else jnp.asarray([[1] * 10 + [2] * 14, [1] * 24])
  ref = attention.einsum_attention(q, k, v, pos, seg, cached=False, dtype=jnp.float32,
                                   window=W)
  full = attention.einsum_attention(q, k, v, pos, seg, cached=False, dtype=jnp.float32)
  fn = {"cpu": functools.partial(attention.cpu_attention, dtype=jnp.float32, query_blocks=1),
        "cpu_4": functools.partial(attention.cpu_attention, dtype=jnp.float32, query_blocks=4),
        "xla": functools.partial(attention.xla_attention, implementation="xla"),
        "splash": None}[impl]
  if impl == "splash":
    got = attention.splash_attention(q, k, v, pos, None, interpret=True, window=W)
  else:
    got = fn(q, k, v, pos, seg, cached=False, window=W)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5)
  assert not np.allclose(ref[:, W + 2:], full[:, W + 2:], atol=1e-3)  # the window matters
  # the cache path: queries at per-row positions against a 30-slot cache
  qc, kc, vc = _qkv(3, 30, seed=1)
  pc = jnp.asarray([[9, 10, 11], [20, 21, 22]])
  ref = attention.einsum_attention(qc, kc, vc, pc, None, cached=True, dtype=jnp.float32,
                                   window=W)
  for kernel in (functools.partial(attention.cpu_attention, dtype=jnp.float32),
                 functools.partial(attention.xla_attention, implementation="xla")):
    np.testing.assert_allclose(kernel(qc, kc, vc, pc, None, cached=True, window=W), ref,
                               rtol=1e-5, atol=2e-5)


def _family_config(kind="parallel", impl="cpu"):
  c = tiny_config(kind, 3)
  m = c.model
  m.qkv_bias, m.qk_norm, m.head_dim, m.sliding_window = True, True, 12, 5
  m.rope_scaling, m.rope_factor, m.rope_original_max_len = "llama3", 4.0, 8
  m.attention_impl = impl
  return c


@pytest.mark.parametrize("kind, impl", [("parallel", "cpu"), ("projection", "einsum"),
                                        ("sequential", "xla")])
@pytest.mark.slow
def test_kv_cache_equals_full_forward_with_every_feature(kind, impl):
  """Prefill 4 tokens, two one-token steps, then a 4-token window (as speculative decoding
  verifies), with biases, qk-norm, head_dim 12 != 32 / 4, llama3 RoPE and a 5-token window over
  10 positions: head 1 equals the no-cache forward."""
  c = _family_config(kind, impl)
  model, params = tiny_model(c)
  a = model.args
  assert a.head_dim == 12 and params["trunk"]["layers"]["attention"]["wq"]["bias"].shape[-2:] \
      == (4, 12)
  S, P, L = 10, 4, 16
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, S), 0, a.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(S), (2, S))

  @jax.jit
  def run(params):
    apply = lambda *x: model.apply({"params": params}, *x)
    h_ref, _ = apply(tokens)
    h, cache = apply(tokens[:, :P], None, positions[:, :P], init_decode_cache(a, 2, L))
    hs = [h]
    for lo, hi in ((P, P + 1), (P + 1, P + 2), (P + 2, S)):  # two one-token steps, a window
      h, cache = apply(tokens[:, lo:hi], None, positions[:, lo:hi], cache)
      hs.append(h)
    return h_ref, jnp.concatenate(hs, axis=2)

  h_ref, h_cached = run(params)
  np.testing.assert_allclose(h_cached[0], h_ref[0], rtol=1e-5, atol=2e-5)
  if kind != "parallel":
    return
  # Each feature changes the output (none is silently ignored).
  for field, value in (("qkv_bias", False), ("qk_norm", False), ("sliding_window", 0),
                       ("rope_scaling", "none")):
    c2 = _family_config(kind, impl)
    setattr(c2.model, field, value)
    m2, _ = tiny_model(c2)
    p2 = {"qkv_bias": lambda: _drop(params, "bias"),
          "qk_norm": lambda: _drop(params, "q_norm", "k_norm")}.get(field, lambda: params)()
    h2, _ = jax.jit(lambda p, m2=m2: m2.apply({"params": p}, tokens))(p2)
    assert float(jnp.max(jnp.abs(h2[0] - h_ref[0]))) > 1e-3, field


def _drop(tree, *names):
  if isinstance(tree, dict):
    return {k: _drop(v, *names) for k, v in tree.items() if k not in names}
  return tree


def test_family_fields_validated():
  for field, value, words in (("head_dim", 7, "model.head_dim"),
                              ("rope_scaling", "dynamic", "model.rope_scaling"),
                              ("sliding_window", -1, "model.sliding_window"),
                              ("rope_factor", 0.5, "model.rope_factor")):
    c = tiny_config()
    setattr(c.model, field, value)
    with pytest.raises(ValueError, match=words):
      validation.validate(c)
  c = tiny_config()
  c.model.rope_scaling, c.model.rope_high_freq_factor = "llama3", 0.5
  with pytest.raises(ValueError, match="model.rope_high_freq_factor"):
    validation.validate(c)
  c = tiny_config()
  c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 3, 1, 8  # 32 % 3 != 0: fine with it
  validation.validate(c)


def test_flops_count_head_dim_biases_and_window():
  c = tiny_config("parallel", 1)
  base = flops.flops_per_token(c, train=False)
  c.model.head_dim = 16  # q, k, v, o twice as wide: 4 * 16 = 64 != 32
  c.model.qkv_bias = True
  got = flops.flops_per_token(c, train=False)
  d, f, q, kv = 32, 64, 64, 32
  assert got["trunk"] == 3 * (2 * (2 * d * q + 2 * d * kv + 3 * d * f) + q + 2 * kv)
  assert got["attention"] == 2 * base["attention"]
  c.model.sliding_window = 4
  assert flops.flops_per_token(c, train=False)["attention"] == got["attention"] * 4 / 16
