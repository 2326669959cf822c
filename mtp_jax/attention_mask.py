"""Which keys a query sees: the one definition every attention kernel computes
(mtp_jax/attention.py's docstring states it), as a boolean mask for the kernels that take one."""

from __future__ import annotations

import jax.numpy as jnp

NEG = -1e30  # finite: a fully masked row (a padding query) stays a uniform softmax, never NaN


def visible_BxSxT(positions_BxS, segment_ids_BxS, T: int, cached: bool, window: int = 0):
  """Boolean [B, S, T] mask of the keys each query sees (the reference's definition)."""
  if cached and segment_ids_BxS is None:
    slots_T = jnp.arange(T)[None, None, :]
    mask_BxSxT = slots_T <= positions_BxS[:, :, None]
    if window:
      mask_BxSxT &= positions_BxS[:, :, None] - slots_T < window
    return mask_BxSxT
  if cached:  # a tree window at slots positions[:, 0] + j; bit j of a query's id: it sees j
    # (bits past the window's tokens are clear, so a query may stand alone: layers.Attention's
    # at_B passes one node's bits with the window's first position)
    S = positions_BxS.shape[1]
    j_Bx1xT = jnp.arange(T)[None, None, :] - positions_BxS[:, :1, None]
    bit_BxSxT = (segment_ids_BxS[:, :, None] >> jnp.clip(j_Bx1xT, 0, 31)) & 1
    mask_BxSxT = (j_Bx1xT < 0) | ((j_Bx1xT < 32) & (bit_BxSxT == 1))
    if window:  # a cache slot's position is the slot; a tree node's is its own position
      node_BxT = jnp.take_along_axis(positions_BxS, jnp.clip(j_Bx1xT[:, 0], 0, S - 1), axis=1)
      key_BxT = jnp.where(j_Bx1xT[:, 0] < 0, jnp.arange(T)[None, :], node_BxT)
      mask_BxSxT &= positions_BxS[:, :, None] - key_BxT[:, None, :] < window
    return mask_BxSxT
  mask_BxSxT = positions_BxS[:, :, None] >= positions_BxS[:, None, :]
  if window:
    mask_BxSxT &= positions_BxS[:, :, None] - positions_BxS[:, None, :] < window
  if segment_ids_BxS is not None:
    mask_BxSxT &= segment_ids_BxS[:, :, None] == segment_ids_BxS[:, None, :]
  return mask_BxSxT
