"""Layer pieces with a hand-written or CPU-specific form: SwiGLU's gate backward against autodiff,
RoPE's tables computed once per step on XLA:CPU and the rotation exactly the formula."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def test_silu_gate_gradient_is_autodiffs():
  """layers.silu_gate (SwiGLU's gate on the fused w1|w3 output, with a hand-written backward
  that writes [d gate | d up] in one pass) against autodiff of silu(gate) * up."""
  from mtp_jax.layers import silu_gate
  x_TxF2 = 3 * jax.random.normal(jax.random.PRNGKey(0), (16, 24))
  d_TxF = jax.random.normal(jax.random.PRNGKey(1), (16, 12))
  plain = lambda x: jax.nn.silu(x[:, :12]) * x[:, 12:]
  want, want_vjp = jax.vjp(plain, x_TxF2)
  got, got_vjp = jax.vjp(silu_gate, x_TxF2)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(got_vjp(d_TxF)[0], want_vjp(d_TxF)[0], rtol=1e-6, atol=1e-6)


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
