"""The backend of every platform without one of its own (`mtp_jax.backends.current()`): XLA's
dot, the layers as written, the config's values. The fused projections are the CPU backend's
code, run here only when model.fuse_projections is "on"."""

from __future__ import annotations

import jax
from jax import lax

from mtp_jax.backends.cpu.fused import fused_dense, silu_gate
from mtp_jax.model_args import ModelArgs

__all__ = ["batch_slices_auto", "cache_write", "decode_compiler_options", "dot_general",
           "fuse_projections", "fused_dense", "real_vocab_only", "silu_gate", "trunk_unroll_auto",
           "written_once"]


def dot_general(a: ModelArgs):
  """XLA's dot (model.cpu_matmul applies to one CPU device only)."""
  del a
  return lax.dot_general


def fuse_projections(a: ModelArgs) -> bool:
  return a.fuse_projections == "on"


def written_once(*tables):
  """The tables behind an optimization barrier, which these compilers keep (their dots may round
  f32 inputs, so no identity dot)."""
  return jax.lax.optimization_barrier(tables)


def cache_write(cache_BxKxTxE, new_BxSxKxE, rows_Bx1, slots_BxS):
  """The cache (heads-major, [B, K, T, E]) with the new keys or values written at (row, slot),
  one scatter that XLA updates in place: (rows, slots) index [B, S] and the slice keeps K, so
  the update is [B, S, K, E], the new keys as they are."""
  return cache_BxKxTxE.at[rows_Bx1, :, slots_BxS].set(new_BxSxKxE.astype(cache_BxKxTxE.dtype))


def trunk_unroll_auto(a: ModelArgs) -> int:
  del a
  return 1  # compile time flat in depth


def batch_slices_auto(rows: int) -> int:
  del rows
  return 1


def real_vocab_only() -> bool:
  return False  # the padded vocabulary shards; pad logits are masked


def decode_compiler_options(batch: int) -> dict | None:
  del batch
  return None
