"""The `cpu` attention kernel (model.attention_impl; what "auto" picks on a CPU backend): the
same function as the reference (`attention.einsum_attention`), shaped for XLA:CPU's GEMMs and
fusions (docs/cpu_speed.md). Exact on any backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.attention_mask import NEG, visible_BxSxT as visible_mask

CPU_QUERY_BLOCKS = 4  # query blocks of the cpu kernel's causal pass (docs/cpu_speed.md)


def _bias(visible, dtype=jnp.float32):
  """0 where visible, NEG elsewhere: an add XLA fuses into the softmax, not a select."""
  return jnp.where(visible, 0.0, NEG).astype(dtype)


def cpu_attention(q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxS, segment_ids_BxS, *,
                  cached: bool, dtype, query_blocks: int | None = None, window: int = 0,
                  kv_heads_major: bool = False):
  """Heads-major attention for XLA:CPU. q, k, v are transposed once to [B, K, rows, E], so every
  matmul is a plain batched GEMM over (b, k) with the G query heads of a kv head stacked as
  rows ([G*S, E] x [E, T]: GQA's shared keys are read once). The mask is an additive bias (the
  causal part a compile-time constant), and without a cache the S queries are cut into
  `query_blocks` blocks (default CPU_QUERY_BLOCKS), block i attending only to keys
  [0, end of block i): with n blocks (n - 1) / 2n of the logits, their softmax and their
  gradients are never computed (3/8 with 4; 8 blocks measured slower: smaller GEMMs).
  Without a cache, v is transposed to [B, K, E, T] instead, so the p v matmul contracts the
  minor axis of both operands, as q k^T does (faster, the same values to the last bit).
  `kv_heads_major`: k and v are already [B, K, T, E], as the KV cache stores them, so a decoding
  step reads the cache in place instead of transposing every layer's whole cache per step."""
  B, S, H, E = q_BxSxHxE.shape
  if kv_heads_major:
    K, T = k_BxTxKxE.shape[1:3]
    k_BxKxTxE, v_heads, v_axes = k_BxTxKxE, v_BxTxKxE, "bkte"
  else:
    T, K = k_BxTxKxE.shape[1:3]
    k_BxKxTxE = k_BxTxKxE.transpose(0, 2, 1, 3)
    v_heads, v_axes = ((v_BxTxKxE.transpose(0, 2, 1, 3), "bkte") if cached
                       else (v_BxTxKxE.transpose(0, 2, 3, 1), "bket"))
  G = H // K
  n_blocks = 1 if cached else (query_blocks or CPU_QUERY_BLOCKS)
  if S % n_blocks:
    n_blocks = 1
  q_BxKxGxSxE = (q_BxSxHxE * jnp.asarray(1 / np.sqrt(E), q_BxSxHxE.dtype)).reshape(
      B, S, K, G, E).transpose(0, 2, 3, 1, 4)
  if cached:  # decode: few queries against the whole cache, one block
    visible_BxSxT = visible_mask(positions_BxS, segment_ids_BxS, T, True, window)
    bias_Bx1x1xSxT = _bias(visible_BxSxT)[:, None, None]
  Sb = S // n_blocks
  outs = []
  for i in range(n_blocks):
    lo, hi = i * Sb, (i + 1) * Sb
    Ti = T if cached else hi  # keys past the block's last query are invisible to all of it
    q_BxKxGSbxE = q_BxKxGxSxE[:, :, :, lo:hi].reshape(B, K, G * Sb, E)
    logits_BxKxGxSbxTi = jnp.einsum(
        "bkqe,bkte->bkqt", q_BxKxGSbxE, k_BxKxTxE[:, :, :Ti],
        preferred_element_type=jnp.float32).reshape(B, K, G, Sb, Ti)
    if cached:
      bias = bias_Bx1x1xSxT
    else:
      back_SbxTi = np.arange(lo, hi)[:, None] - np.arange(Ti)[None, :]  # query - key index
      causal_SbxTi = (back_SbxTi >= 0) & ((back_SbxTi < window) if window else True)
      bias = jnp.asarray(np.where(causal_SbxTi, 0.0, NEG).astype(np.float32))
      if segment_ids_BxS is not None:
        same_BxSbxTi = segment_ids_BxS[:, lo:hi, None] == segment_ids_BxS[:, None, :Ti]
        bias = bias + _bias(same_BxSbxTi)[:, None, None]
    v_i = jax.lax.slice_in_dim(v_heads, 0, Ti, axis=v_axes.index("t"))
    outs.append(_softmax_times_v((logits_BxKxGxSbxTi + bias).reshape(B, K, G * Sb, Ti), v_i,
                                 dtype, v_axes).reshape(B, K, G, Sb, E))
  out_BxKxGxSxE = outs[0] if n_blocks == 1 else jnp.concatenate(outs, axis=3)
  return out_BxKxGxSxE.transpose(0, 3, 1, 2, 4).reshape(B, S, H, E)


def _softmax_times_v(logits_BxKxQxT, v, dtype, v_axes: str = "bkte"):
  """softmax(logits) v, normalised after the matmul as flash attention does: p = exp(logits -
  max) and its row sums l, then (p v) / l. The division runs over [Q, E] instead of [Q, T], and
  with the max held constant (softmax does not depend on it) the backward pass is p * (dP -
  rowsum(dO * out)) / l, a sum over E, not T: one elementwise pass over [Q, T] where softmax's
  gradient takes two.
  `v_axes`: v's einsum axes, "bkte" ([B, K, T, E]) or "bket" ([B, K, E, T])."""
  max_BxKxQx1 = jax.lax.stop_gradient(jnp.max(logits_BxKxQxT, axis=-1, keepdims=True))
  p_BxKxQxT = jnp.exp(logits_BxKxQxT - max_BxKxQx1)
  sum_BxKxQx1 = jnp.sum(p_BxKxQxT, axis=-1, keepdims=True)
  out_BxKxQxE = jnp.einsum(f"bkqt,{v_axes}->bkqe", p_BxKxQxT.astype(dtype), v,
                           preferred_element_type=jnp.float32)
  return (out_BxKxQxE / sum_BxKxQx1).astype(dtype)
