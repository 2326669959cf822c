"""Layer pieces with a hand-written or CPU-specific form: SwiGLU's gate backward against autodiff,
RoPE's tables computed once per step on XLA:CPU and the rotation exactly the formula, the KV
cache written in place by the decoding loop."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def test_silu_gate_gradient_is_autodiffs():
  """fused.silu_gate (SwiGLU's gate on the fused w1|w3 output, with a hand-written backward
  that writes [d gate | d up] in one pass) against autodiff of silu(gate) * up."""
  from mtp_jax.backends.cpu.fused import silu_gate
  x_TxF2 = 3 * jax.random.normal(jax.random.PRNGKey(0), (16, 24))
  d_TxF = jax.random.normal(jax.random.PRNGKey(1), (16, 12))
  plain = lambda x: jax.nn.silu(x[:, :12]) * x[:, 12:]
  want, want_vjp = jax.vjp(plain, x_TxF2)
  got, got_vjp = jax.vjp(silu_gate, x_TxF2)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(got_vjp(d_TxF)[0], want_vjp(d_TxF)[0], rtol=1e-6, atol=1e-6)


def test_silu_gate_gradient_written_by_one_fusion_on_cpu():
  """Between the fused w1|w3 projection and w2, as in SwiGLU, the backward writes [d gate | d up]
  in one loop over its [T, 2, F] view: no concatenate of two halves computed apart (the earlier
  form's, 10.7 ms a layer of the default train step on the model-167 Xeon), and the first half
  is the gate's formula, the second the up's."""
  from mtp_jax.backends.cpu.fused import silu_gate
  T, D, F = 512, 32, 96
  x_TxD, w1_Dx2F, w2_FxD = (jax.random.normal(jax.random.PRNGKey(i), s)
                            for i, s in enumerate([(T, D), (D, 2 * F), (F, D)]))
  loss = lambda x, w1, w2: jnp.sum(jnp.sin(silu_gate(x @ w1) @ w2))
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x_TxD, w1_Dx2F, w2_FxD).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  assert "concatenate(" not in entry, entry
  assert len(re.findall(rf"= f32\[{T},{2 * F}\]\S* fusion\(.*kind=kLoop", entry)) == 1, entry
  x_TxF2 = 3 * jax.random.normal(jax.random.PRNGKey(3), (T, 2 * F))
  d_TxF = jax.random.normal(jax.random.PRNGKey(4), (T, F))
  got = jax.vjp(silu_gate, x_TxF2)[1](d_TxF)[0]
  gate, up = x_TxF2[:, :F], x_TxF2[:, F:]
  sig = jax.nn.sigmoid(gate)
  np.testing.assert_allclose(got[:, :F], d_TxF * up * (sig + gate * sig * (1 - sig)), rtol=1e-6)
  np.testing.assert_allclose(got[:, F:], d_TxF * gate * sig, rtol=1e-6)


def test_rope_tables_written_once_on_cpu():
  """RoPE's sin and cos tables are evaluated once per train step on XLA:CPU, not again inside
  every rope and rope gradient (layers.written_once), and the rotation is exactly the formula."""
  from mtp_jax.layers import rope
  inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32)
  positions_BxS = jnp.broadcast_to(jnp.arange(6), (2, 6))
  x_BxSxHxE = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 3, 8))

  def layers(w_L, x):
    for w in w_L:
      x = rope(x * w, positions_BxS, inv_freq)
    return jnp.sum(x * x)
  hlo = jax.jit(jax.grad(layers)).lower(jnp.ones(3), x_BxSxHxE).compile().as_text()
  assert hlo.count("cosine(") == 1 and hlo.count(" sine(") == 1, hlo
  ang = np.arange(6, dtype=np.float32)[:, None] * inv_freq
  sin, cos = jnp.sin(ang)[None, :, None], jnp.cos(ang)[None, :, None]
  x1, x2 = x_BxSxHxE[..., :4], x_BxSxHxE[..., 4:]
  np.testing.assert_array_equal(
      rope(x_BxSxHxE, positions_BxS, inv_freq),
      jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1))
  # a decoding step's tables (once=False: sin and cos evaluated in their consumers), the same bits
  step = lambda once: jax.jit(lambda x, p: rope(2 * x, p, inv_freq, 1.0, once))(
      x_BxSxHxE[:, :1], positions_BxS[:, :1] + 3)
  np.testing.assert_array_equal(step(True), step(False))


@pytest.mark.slow
@pytest.mark.parametrize("batch, kv_heads", [(1, 1), (1, 2), (3, 2)])
def test_decode_loop_writes_the_kv_cache_in_place(batch, kv_heads):
  """Inside the compiled decoding loop no KV cache is copied: each layer's new keys and values
  are one in-place scatter into the heads-major cache, read there by attention. (At batch 1 a
  one-index scatter became a dynamic-update-slice that XLA fused into each reader, each on a
  copy of the whole cache: 5 copies per cache and token before cpu_ops.cache_write. With one kv
  head at batch > 1 XLA still relayouts the trunk's caches, [1, B, 1, T, E] {4,3,1,2,0} against
  {4,3,2,1,0}, which only a model with a single kv head meets.)"""
  from conftest import random_params, tiny_config
  from mtp_jax.decoding import decode as decode_lib
  from mtp_jax.model import build_model
  c = tiny_config("parallel", 2)
  c.model.n_kv_heads = kv_heads  # 1: one token at batch 1 is a single (row, slot, head)
  model = build_model(c)
  prompt_len, new = 5, 12
  dec = decode_lib.Decoder(random_params(model), model.args, k=1, batch=batch,
                           prompt_len=prompt_len, max_new_tokens=new)
  hlo = dec._compiled.as_text()
  length = prompt_len + new + 1  # the cache's slots
  bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
  assert bodies, "no while loop in the compiled decoder"
  copies = []
  for comp in re.split(r"\n(?=\S)", hlo):
    if comp.split(" ", 1)[0].lstrip("%") in bodies:
      copies += [line for line in comp.splitlines() if " copy(" in line
                 and re.search(rf"f32\[[\d,]*\b{length}\b[\d,]*\]", line.split("=", 1)[1][:60])]
  assert not copies, "\n".join(copies)
