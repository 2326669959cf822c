"""The CPU backend's side of the seam (`mtp_jax.backends.current()` on XLA:CPU): the choices
that make a trace fast on XLA:CPU, each the same maths as `backends.generic`'s. Why each one
pays, with the figures, is in docs/cpu_speed.md."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

from mtp_jax.backends.cpu.fused import fused_dense, silu_gate
from mtp_jax.backends.platform import one_cpu_device
from mtp_jax.model_args import ModelArgs

__all__ = ["batch_slices_auto", "cache_write", "decode_compiler_options", "dot_general",
           "fuse_projections", "fused_dense", "real_vocab_only", "silu_gate", "trunk_unroll_auto",
           "written_once"]


def dot_general(a: ModelArgs):
  """model.cpu_matmul resolved for a trace compiled for one CPU device: the MKL handler's
  dot_general (`gemm.dot_general`) for "mkl", and for "auto" on an Intel CPU where MKL is at hand,
  unless a remat policy saves dots (it would not know MKL's custom call for one, and recompute
  it); lax.dot_general for "xla" and under a mesh. The handler is imported only here."""
  if a.cpu_matmul == "xla" or not one_cpu_device():
    return lax.dot_general
  from mtp_jax.backends.cpu import gemm
  if a.cpu_matmul == "auto":
    mkl = gemm.intel_cpu() and not a.remat_policy.startswith("dots") and gemm.available()
    return gemm.dot_general if mkl else lax.dot_general
  if not gemm.available():  # validation says so first; a config built past it lands here
    raise ValueError(f"model.cpu_matmul: mkl is not available here: "
                     f"{gemm.unavailable_reason()} (auto or xla are)")
  return gemm.dot_general


def fuse_projections(a: ModelArgs) -> bool:
  """model.fuse_projections: "on", "off", or for "auto" on one CPU device (under a mesh the
  concatenation would move tensor-parallel kernel shards)."""
  return a.fuse_projections == "on" or (a.fuse_projections == "auto" and one_cpu_device())


def written_once(*tables_Bx_xF):
  """The f32 tables, computed once and read by every consumer. XLA:CPU fuses a cheap producer
  (RoPE's sin and cos) into each consumer and expands `optimization_barrier` before fusing; a
  dot is never fused into its consumers, so the tables, side by side, times the identity are
  written once, exactly (each output is one product by 1.0 plus products by 0.0)."""
  F = tables_Bx_xF[0].shape[-1]
  both = jnp.concatenate(tables_Bx_xF, axis=-1)
  both = jnp.einsum("...f,fg->...g", both, jnp.eye(both.shape[-1], dtype=both.dtype),
                    precision=jax.lax.Precision.HIGHEST)
  return tuple(both[..., i * F:(i + 1) * F] for i in range(len(tables_Bx_xF)))


def cache_write(cache_BxKxTxE, new_BxSxKxE, rows_Bx1, slots_BxS):
  """`generic.cache_write`, except that a single (row, slot) (one token at batch 1) is written
  twice, the same value at the same place: XLA:CPU turns a one-index scatter into a
  dynamic-update-slice fused into every reader of the cache, each on a copy of its own, where a
  scatter stays one in-place write. Duplicate indices land in any order; both hold one value."""
  new_BxSxKxE = new_BxSxKxE.astype(cache_BxKxTxE.dtype)
  if rows_Bx1.shape[0] * slots_BxS.shape[1] == 1:
    rows_Bx1 = jnp.concatenate([rows_Bx1, rows_Bx1], axis=1)
    slots_BxS, new_BxSxKxE = (jnp.concatenate([x, x], axis=1) for x in (slots_BxS, new_BxSxKxE))
  return cache_BxKxTxE.at[rows_Bx1, :, slots_BxS].set(new_BxSxKxE)


def trunk_unroll_auto(a: ModelArgs) -> int:
  """model.scan_unroll = 0: the whole trunk in line on one CPU device (XLA:CPU's backward of a
  scanned stack copies every layer's residuals in and out of stacked buffers), else 1."""
  return a.n_trunk if one_cpu_device() else 1


def batch_slices_auto(rows: int) -> int:
  """train.batch_slices = 0: 2 slices on one CPU device of 2 cores and a micro-batch of even
  rows (the slices' ops then run side by side on XLA:CPU's thread pool), else 1; other core
  counts keep 1 until measured."""
  return 2 if one_cpu_device() and _cores() == 2 and rows % 2 == 0 else 1


def _cores() -> int:
  return len(os.sched_getaffinity(0))


def real_vocab_only() -> bool:
  """Whether the loss multiplies the real vocabulary columns only: on one CPU device nothing
  shards, so the pad columns would only be multiplied and masked."""
  return one_cpu_device()


def decode_compiler_options(batch: int) -> dict | None:
  """A decoding program's compile options (`runtime.decode_compiler_options`)."""
  from mtp_jax.backends.cpu import runtime
  return runtime.decode_compiler_options(batch)
