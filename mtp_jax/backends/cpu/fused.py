"""Several projections of one input as one matmul, and SwiGLU's gate with a one-pass backward:
on one CPU device one wide GEMM beats several narrow ones (model.fuse_projections, auto there).
Same maths as a DenseGeneral per projection and as autodiff's gradient (docs/cpu_speed.md)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@jax.custom_vjp
def silu_gate(gate_up_TxF2):
  """silu(gate) * up of [gate | up] side by side (SwiGLU's fused w1, w3 projection), with the
  gradient written back side by side in one elementwise pass that the fused projection's
  backward GEMMs read as is (autodiff's took several passes and a concatenate on XLA:CPU)."""
  gate, up = jnp.split(gate_up_TxF2, 2, axis=-1)
  return nn.silu(gate) * up


def _silu_gate_fwd(gate_up_TxF2):
  return silu_gate(gate_up_TxF2), gate_up_TxF2


def _silu_gate_bwd(gate_up_TxF2, d_out_TxF):
  """[d gate | d up] as one elementwise pass over a [T, 2, F] view: both halves read gate, up
  and the cotangent broadcast over the middle axis and each writes its own formula, so XLA:CPU
  fuses it into ONE loop (a concatenate of two halves stays an op of its own). The same values
  to the last bit."""
  T, F = d_out_TxF.shape
  gate_up_Tx2xF = gate_up_TxF2.reshape(T, 2, F)
  gate, up = (jnp.broadcast_to(gate_up_Tx2xF[:, i:i + 1], (T, 2, F)) for i in (0, 1))
  d_out = jnp.broadcast_to(d_out_TxF[:, None], (T, 2, F))
  sig = jax.nn.sigmoid(gate)
  silu = gate * sig
  is_gate = jax.lax.broadcasted_iota(jnp.int32, (T, 2, F), 1) == 0
  # d silu / d x = s + x s (1 - s)
  d = jnp.where(is_gate, d_out * up * (sig + silu * (1 - sig)), d_out * silu)
  return (d.reshape(T, 2 * F),)


silu_gate.defvjp(_silu_gate_fwd, _silu_gate_bwd)


def fused_dense(x_TxD, params, dtype, split: bool = True, dot=lax.dot_general):
  """[x @ kernel_i (+ bias_i) for (kernel_i, bias_i) in params] as ONE matmul against the kernels
  concatenated on their output axis, then split (`split=False`: the [T, sum of widths] output
  as is): the backward's weight gradient is one GEMM and its input gradient one GEMM instead of
  one per projection plus their sum. Same maths as a DenseGeneral per projection (kernels
  [D, *features])."""
  widths = [math.prod(k.shape[1:]) for k, _ in params]
  w_DxN = jnp.concatenate([k.reshape(k.shape[0], -1) for k, _ in params], axis=1)
  y_TxN = dot(x_TxD.astype(dtype), w_DxN.astype(dtype), (((1,), (0,)), ((), ())))
  if params[0][1] is not None:
    y_TxN = y_TxN + jnp.concatenate([b.reshape(-1) for _, b in params]).astype(dtype)
  if not split:
    return y_TxN
  outs = jnp.split(y_TxN, np.cumsum(widths)[:-1], axis=1)
  return [o.reshape(x_TxD.shape[0], *k.shape[1:]) for o, (k, _) in zip(outs, params)]
