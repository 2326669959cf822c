"""Causal grouped-query attention kernels, chosen by `config.model.attention_impl`.

    einsum  the reference: [B, K, G, S, T] f32 logits, a boolean mask, a select (any backend)
    cpu     heads-major batched matmuls, an additive bias, causal query blocks that skip the keys
            no query of the block can see (XLA:CPU; exact, any backend)
    xla     jax.nn.dot_product_attention(implementation="xla")
    cudnn   jax.nn.dot_product_attention(implementation="cudnn"): flash attention on NVIDIA GPUs
    splash  the Pallas splash-attention kernel (TPU; causal and segment ids as block masks)
    auto    cudnn on GPU, splash on TPU, cpu elsewhere

The platform is the one the code is compiled for: the device platform of the mesh in context
(`jax.set_mesh`, as training and plan_memory enter it), else jax's default backend. So an
ahead-of-time compile for a TPU topology on a CPU host (plan_memory.py --target tpu:...) picks
splash, and one for a GPU mesh cudnn.

Every kernel computes the same function. Without a cache, query s sees key t <= s of its own
segment (positions increase along the sequence, so this is the reference's positions test);
with a cache, query s sees cache slot t <= positions[b, s], or, given segment ids with a cache
(a tree of drafts, `mtp_jax.decoding.tree`), the slots before the window and window slot
positions[b, 0] + j where bit j of segment_ids[b, s] is set. With `window` W > 0 (Mistral's
sliding window, model.sliding_window) a query also sees only the W most recent of those keys
(query position - key position < W, as transformers' sliding-window mask).
A kernel that cannot take a case
(cudnn: the cache, f32; splash: the cache, not on a TPU) hands it to `xla`
(`cpu` on a CPU backend), and says why once in the log. The fused kernels take causality as a
flag, never as an [S, T] mask in memory; the one mask a fused kernel gets is cudnn's for packed
documents (jax.nn.dot_product_attention's cudnn path has no segment ids): a [B, 1, S, T]
additive bf16 bias, a fraction of the [B, H, S, T] f32 logits `xla` would hold instead.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mtp_jax import sharding
from mtp_jax.attention_mask import NEG, visible_BxSxT as _visible_BxSxT
from mtp_jax.backends.cpu.attention import cpu_attention
from mtp_jax.backends.platform import target_platform

_logged: set[str] = set()
log = logging.getLogger(__name__)


def _note_fallback(asked: str, used: str, why: str):
  msg = f"attention_impl={asked!r}: {why}; using {used!r}"
  if msg not in _logged:
    _logged.add(msg)
    log.warning(msg)


def resolve(impl: str, *, cached: bool, segments: bool, dtype, backend: str | None = None) -> str:
  """The kernel that runs for this case (static: called while tracing) on `backend` (default:
  `target_platform()`)."""
  backend = backend or target_platform()
  generic = "cpu" if backend == "cpu" else "xla"
  if impl == "auto":
    impl = {"gpu": "cudnn", "cuda": "cudnn", "tpu": "splash"}.get(backend, "cpu")
    asked = "auto"
  else:
    asked = impl
  why = None
  if impl == "cudnn":
    if backend not in ("gpu", "cuda"):
      why = f"cudnn needs an NVIDIA GPU, the backend is {backend}"
    elif cached:
      why = "cudnn has no per-row cache positions (the decode path)"
    elif jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
      why = f"cudnn flash attention takes bfloat16/float16, got {jnp.dtype(dtype).name}"
  elif impl == "splash":
    if backend != "tpu":
      why = f"splash is a TPU kernel, the backend is {backend}"
    elif cached:
      why = "splash has no per-row cache positions (the decode path)"
  if why is not None:
    _note_fallback(asked, generic, why)
    return generic
  return impl


def attend(q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxS, segment_ids_BxS=None, *,
           cached: bool, impl: str = "auto", dtype=jnp.float32, window: int = 0,
           kv_heads_major: bool = False):
  """softmax(q k^T / sqrt(E) + mask) v for grouped-query heads; returns out_BxSxHxE in dtype.
  `window` > 0: a query sees only keys less than `window` positions back (sliding window).
  `kv_heads_major`: k and v come as [B, K, T, E] (the KV cache's layout, layers.init_cache),
  which the cpu kernel reads as they are; the others get them transposed to [B, T, K, E]."""
  used = resolve(impl, cached=cached, segments=segment_ids_BxS is not None, dtype=dtype)
  k, v = k_BxTxKxE.astype(dtype), v_BxTxKxE.astype(dtype)
  if used == "cpu":
    return cpu_attention(q_BxSxHxE, k, v, positions_BxS, segment_ids_BxS, cached=cached,
                         dtype=dtype, window=window, kv_heads_major=kv_heads_major)
  if kv_heads_major:
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  args = (q_BxSxHxE, k, v, positions_BxS, segment_ids_BxS)
  if used == "einsum":
    return einsum_attention(*args, cached=cached, dtype=dtype, window=window)
  if used == "xla":
    return xla_attention(*args, cached=cached, implementation="xla", window=window)
  try:  # the fused kernels check shapes and dtypes while tracing
    if used == "cudnn":
      return _on_mesh(xla_attention, *args, cached=cached, implementation="cudnn", window=window)
    return _on_mesh(splash_attention, *args, window=window)
  except (ValueError, NotImplementedError, RuntimeError) as e:
    _note_fallback(impl, "xla", f"{used} refused this case ({str(e).splitlines()[0]})")
    return xla_attention(*args, cached=cached, implementation="xla", window=window)


def einsum_attention(q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxS, segment_ids_BxS, *,
                     cached: bool, dtype, window: int = 0):
  """The reference: f32 [B, K, G, S, T] logits over every (query, key) pair, masked by select."""
  B, S, H, E = q_BxSxHxE.shape
  K = k_BxTxKxE.shape[2]
  mask_BxSxT = _visible_BxSxT(positions_BxS, segment_ids_BxS, k_BxTxKxE.shape[1], cached,
                              window)
  q_BxSxKxGxE = q_BxSxHxE.reshape(B, S, K, H // K, E)
  logits_BxKxGxSxT = jnp.einsum("bskge,btke->bkgst", q_BxSxKxGxE, k_BxTxKxE,
                                preferred_element_type=jnp.float32) / jnp.sqrt(E)
  logits_BxKxGxSxT = jnp.where(mask_BxSxT[:, None, None], logits_BxKxGxSxT, NEG)
  probs = jax.nn.softmax(logits_BxKxGxSxT, axis=-1).astype(dtype)
  out_BxSxKxGxE = jnp.einsum("bkgst,btke->bskge", probs, v_BxTxKxE)
  return out_BxSxKxGxE.reshape(B, S, H, E)


def xla_attention(q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxS, segment_ids_BxS, *,
                  cached: bool, implementation: str, window: int = 0):
  """jax.nn.dot_product_attention. Causality goes in as `is_causal` (cudnn then skips the masked
  tiles) and a sliding window as `local_window_size` (window - 1 keys back, none ahead); only
  packed segments and the cache, which the API cannot express otherwise, pass a [B, 1, S, T]
  mask (xla materialises its logits anyway; cudnn adds it as a bias)."""
  mask = None
  if cached:
    mask = _visible_BxSxT(positions_BxS, segment_ids_BxS, k_BxTxKxE.shape[1], True,
                          window)[:, None]
  elif segment_ids_BxS is not None:
    mask = (segment_ids_BxS[:, :, None] == segment_ids_BxS[:, None, :])[:, None]
  local = (window - 1, 0) if window and not cached else None
  return jax.nn.dot_product_attention(
      q_BxSxHxE.astype(k_BxTxKxE.dtype), k_BxTxKxE, v_BxTxKxE, mask=mask,
      is_causal=not cached, local_window_size=local, implementation=implementation)


def _on_mesh(kernel, q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxS, segment_ids_BxS, **kw):
  """A fused kernel (splash_attention, or xla_attention for cudnn; no cache), shard_mapped over
  the batch and head axes of the enclosing sharding.activation_rules: GSPMD cannot partition a
  Mosaic kernel ("Mosaic kernels cannot be automatically partitioned"), and the cudnn call's
  custom partitioner fails on the train step's mesh (an AssertionError in jax's
  explode_superdims, XLA:GPU for 4 H100s, fsdp=4). Each device runs the kernel on its own rows
  and heads (a kv head's query heads stay on its device). Outside activation_rules, the plain
  call. `kw` goes to the kernel."""
  active = sharding.active_spec(("batch", "seq", "heads", "head_dim"))
  if active is None:
    return kernel(q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxS, segment_ids_BxS, **kw)
  mesh, q_spec = active
  kv_spec = sharding.active_spec(("batch", "seq", "kv_heads", "head_dim"))[1]
  rows_spec = P(*q_spec[:2])
  segments = segment_ids_BxS is not None
  local = lambda q, k, v, *seg: kernel(q, k, v, None, seg[0] if seg else None, **kw)
  return jax.shard_map(
      local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec) + ((rows_spec,) if segments else ()),
      out_specs=q_spec, check_vma=False)(
          q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, *((segment_ids_BxS,) if segments else ()))


def splash_attention(q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxS, segment_ids_BxS, *,
                     block: int = 128, interpret: bool = False, window: int = 0):
  """The Pallas splash kernel (no cache): a static causal block mask (a LocalMask with a
  sliding window), so fully masked tiles are skipped, and packed documents as SegmentIds.
  Imported here: it only builds on a TPU (or with
  `interpret=True`, how the CPU test runs it)."""
  del positions_BxS
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)
  B, S, H, E = q_BxSxHxE.shape
  K = k_BxTxKxE.shape[2]
  block = min(block, S)
  if S % block:
    raise ValueError(f"splash needs the sequence length ({S}) to be a multiple of {block}")
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block,
                            block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  kernel = splash.make_splash_mha(
      masks.MultiHeadMask([masks.LocalMask((S, S), (window - 1, 0), 0) if window
                           else masks.CausalMask((S, S))] * H), block_sizes=sizes, head_shards=1,
      q_seq_shards=1, interpret=interpret)
  heads_major = lambda x: x.transpose(0, 2, 1, 3)
  # Scale by a Python float (weakly typed): a numpy f32 scalar would promote bf16 q to f32.
  q_BxHxSxE = heads_major((q_BxSxHxE * (1.0 / math.sqrt(E))).astype(k_BxTxKxE.dtype))
  k_BxHxTxE = heads_major(jnp.repeat(k_BxTxKxE, H // K, axis=2))
  v_BxHxTxE = heads_major(jnp.repeat(v_BxTxKxE, H // K, axis=2))
  if segment_ids_BxS is None:
    out_BxHxSxE = jax.vmap(kernel)(q_BxHxSxE, k_BxHxTxE, v_BxHxTxE)
  else:
    seg = splash.SegmentIds(q=segment_ids_BxS, kv=segment_ids_BxS)
    out_BxHxSxE = jax.vmap(kernel)(q_BxHxSxE, k_BxHxTxE, v_BxHxTxE, segment_ids=seg)
  return heads_major(out_BxHxSxE)
