"""Llama-style building blocks: RMSNorm, RoPE, grouped-query attention with an optional KV cache,
SwiGLU MLP, and the pre-norm Block that trunk, parallel heads and sequential depths all share.

Shape suffixes: B batch, S sequence (query) positions, T key positions, L cache length, D model
width, H attention heads, K kv heads, G query heads per kv head, E head size, F MLP width.
Every parameter carries logical axis names; `mtp_jax.sharding` maps them to mesh axes.
"""

from __future__ import annotations

from typing import Any

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mtp_jax import attention, backends, sharding
from mtp_jax.model_args import ModelArgs

Cache = dict[str, jax.Array]  # {"k": [B, K, L, E], "v": [B, K, L, E]}, heads-major


def dense_init(axes):
  """LeCun-normal (1/sqrt(fan_in)) init with logical axis names."""
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)


def fuse_projections(a: ModelArgs) -> bool:
  """model.fuse_projections resolved by the backend: "on", "off", or for "auto" on one CPU
  device (static: called while tracing)."""
  return backends.current().fuse_projections(a)


def dot_general(a: ModelArgs):
  """The dot_general the dense layers and the loss take: the backend's (model.cpu_matmul on one
  CPU device), else lax.dot_general. Static: called while tracing."""
  return backends.current().dot_general(a)


class DenseParams(nn.Module):
  """The kernel (and bias) that `nn.DenseGeneral(features)` over the last input axis creates:
  same names, shapes, init (drawn flat [fan_in, prod(features)], then reshaped) and logical axes,
  without its matmul, so that several projections of one input run as one (`fused_dense`)."""
  features: tuple[int, ...]
  axes: tuple[str, ...]
  use_bias: bool = False

  @nn.compact
  def __call__(self, in_features: int):
    init = dense_init(self.axes)

    def kernel_init(rng, shape, dtype=jnp.float32):
      flat = init(rng, (in_features, math.prod(self.features)), dtype)
      return nn.meta.replace_boxed(flat, jnp.reshape(flat.unbox(), shape))
    kernel = self.param("kernel", kernel_init, (in_features, *self.features), jnp.float32)
    bias = None
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                             self.axes[1:]),
                        self.features, jnp.float32)
    return kernel, bias


def projections(module: nn.Module, x_BxSxD, specs, use_bias: bool, dtype, fused: bool,
                joined: bool = False, dot=lax.dot_general):
  """One projection of x per (features, logical axes, name) in `specs`, each a child named
  `name` with DenseGeneral's params: as one matmul (`fused_dense`) or one DenseGeneral each.
  `joined` (fused only): the one matmul's [B*S, sum of widths] output, not split."""
  B, S, D = x_BxSxD.shape
  if fused:
    params = [DenseParams(f, axes, use_bias, parent=module, name=name)(D)
              for f, axes, name in specs]
    ys = backends.current().fused_dense(x_BxSxD.reshape(B * S, D), params, dtype,
                                        split=not joined, dot=dot)
    return ys if joined else [y.reshape(B, S, *y.shape[1:]) for y in ys]
  assert not joined, "projections: joined needs fused"
  return [tokens_2d(nn.DenseGeneral(
      f, use_bias=use_bias, dtype=dtype, kernel_init=dense_init(axes), dot_general=dot,
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]), parent=module,
      name=name))(x_BxSxD) for f, axes, name in specs]


def remat(module_cls, policy: str, static_argnums=()):
  """Wraps a module class in nn.remat with the configured checkpoint policy ('none': as is)."""
  if policy == "none":
    return module_cls
  policies = {
      "full": jax.checkpoint_policies.nothing_saveable,
      "dots_saveable": jax.checkpoint_policies.dots_saveable,
      "dots_with_no_batch_dims_saveable":
          jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  }
  return nn.remat(module_cls, policy=policies[policy], prevent_cse=False,
                  static_argnums=static_argnums)


def norm_param(module: nn.Module, name: str, dim: int):
  return module.param(name, nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                      (dim,), jnp.float32)


def rms_norm(x_BxSxD, scale_D, eps: float, dtype=None):
  x = x_BxSxD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return (x * scale_D).astype(dtype or x_BxSxD.dtype)


class RMSNorm(nn.Module):
  eps: float = 1e-5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BxSxD):
    return rms_norm(x_BxSxD, norm_param(self, "scale", x_BxSxD.shape[-1]), self.eps, self.dtype)


def rope_frequencies(a: ModelArgs) -> tuple[np.ndarray, float]:
  """(inv_freq [E/2] float32, attention factor) of model.rope_scaling, as transformers'
  modeling_rope_utils computes them: none (default), linear (positions / factor), llama3
  (low frequencies / factor, a smooth ramp between low_freq_factor and high_freq_factor
  wavelengths), yarn (NTK-by-parts ramp between beta_fast and beta_slow rotations; cos and sin
  scaled by the attention factor, 0.1 ln(factor) + 1 unless given)."""
  E, base, factor = a.head_dim, a.rope_theta, a.rope_factor
  pos_freqs = np.float32(base) ** (np.arange(0, E, 2).astype(np.float32) / np.float32(E))
  inv = (1.0 / pos_freqs).astype(np.float32)
  kind, old = a.rope_scaling, a.rope_original_max_len
  if kind == "linear":
    return (inv / np.float32(factor)).astype(np.float32), 1.0
  if kind == "llama3":
    low_wavelen, high_wavelen = old / a.rope_low_freq_factor, old / a.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - a.rope_low_freq_factor) / (
        a.rope_high_freq_factor - a.rope_low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
  if kind == "yarn":
    attn = a.rope_attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    dim_of = lambda rot: E * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(dim_of(a.rope_beta_fast)), 0)
    high = min(math.ceil(dim_of(a.rope_beta_slow)), E - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(E // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    interp = 1.0 / (np.float32(factor) * pos_freqs)
    return (interp * (1 - extrapolation) + inv * extrapolation).astype(np.float32), float(attn)
  return inv, 1.0


def written_once(*tables_Bx_xF):
  """The f32 tables, computed once and read by every consumer, not evaluated again in each
  (the backend's way: an optimization barrier, or on XLA:CPU an identity dot). Same values."""
  return backends.current().written_once(*tables_Bx_xF)


def rope(x_BxSxHxE, positions_BxS, inv_freq: np.ndarray, attention_factor: float = 1.0,
         once: bool = True):
  """Rotary embedding, rotate-half layout (HF Llama); Meta's interleaved-pair checkpoints need
  their q/k rows permuted on import. `inv_freq` from `rope_frequencies` (model.rope_scaling).
  `once`: the sin and cos tables through `written_once`; a batch-1 decoding step (one token)
  passes False, since there writing the tables once costs more than evaluating its few sines
  again in each consumer (at larger batches the sines of every head cost more). Same values."""
  half = x_BxSxHxE.shape[-1] // 2
  ang_BxSx1xE2 = positions_BxS[:, :, None, None].astype(jnp.float32) * jnp.asarray(inv_freq)
  sin, cos = jnp.sin(ang_BxSx1xE2), jnp.cos(ang_BxSx1xE2)
  if attention_factor != 1.0:
    sin, cos = sin * attention_factor, cos * attention_factor
  if once:
    sin, cos = written_once(sin, cos)
  x = x_BxSxHxE.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxSxHxE.dtype)


def tokens_2d(fn):
  """Runs `fn` on [B*S, ...] instead of [B, S, ...]: XLA:CPU turns the weight gradient of a
  matmul that contracts two token axes into a slow loop; one token axis takes the fast GEMM
  (docs/cpu_speed.md)."""
  def wrapped(x_BxSx_, *args):
    B, S = x_BxSx_.shape[:2]
    y = fn(x_BxSx_.reshape(B * S, *x_BxSx_.shape[2:]), *args)
    return y.reshape(B, S, *y.shape[1:])
  return wrapped


def embed_lookup(embedding_VxD, tokens_BxS, dtype) -> jax.Array:
  """Rows of the embedding table for `tokens_BxS`, cast to `dtype` first as nn.Embed does.

  Inside `sharding.activation_rules` the lookup is shard_mapped, so the compiled step never
  reshards the rows: each device all-gathers the table's `embed` shards (as FSDP gathers a
  weight before use) and takes its own batch rows from its `vocab` shard (a masked take summed
  over the vocab's mesh axes; one term of each sum is nonzero, so it is exact). The gradient is
  the collectives' transposes: a reduce-scatter over the embed axes, then a sum over the batch
  axes the table is replicated on. Given the bare take, GSPMD finds no way from the table's rows
  (D split over fsdp) to the residual stream's (rows split over the batch) and replicates the
  rows' cotangent whole on every device ("Involuntary full rematerialization";
  tests/sharding_check.py checks the train step's log). One device, and rows that do not divide
  over the batch axes (a decode batch of 1), take the bare lookup."""
  active = sharding.active_spec(("vocab", "embed"))
  tokens_spec = None if active is None else sharding.active_spec(("batch", "seq"))[1]
  if active is None or active[0].size == 1 or any(
      dim % math.prod(active[0].shape[ax] for ax in sharding.spec_axes(entry))
      for dim, entry in zip(tokens_BxS.shape, tokens_spec)):
    return jnp.take(jnp.asarray(embedding_VxD, dtype), tokens_BxS, axis=0)
  mesh, table_spec = active
  vocab_axes, embed_axes = sharding.spec_axes(table_spec[0]), sharding.spec_axes(table_spec[1])

  def local(table_VxD, tokens_BxS):
    table_VxD = table_VxD.astype(dtype)
    if embed_axes:
      table_VxD = jax.lax.all_gather(table_VxD, embed_axes, axis=1, tiled=True)
    if not vocab_axes:
      return jnp.take(table_VxD, tokens_BxS, axis=0)
    rows = table_VxD.shape[0]
    ids_BxS = tokens_BxS - jax.lax.axis_index(vocab_axes) * rows
    inside_BxS = (ids_BxS >= 0) & (ids_BxS < rows)
    x_BxSxD = jnp.take(table_VxD, jnp.where(inside_BxS, ids_BxS, 0), axis=0)
    return jax.lax.psum(jnp.where(inside_BxS[..., None], x_BxSxD, 0), vocab_axes)

  return jax.shard_map(local, mesh=mesh, in_specs=(table_spec, tokens_spec),
                       out_specs=jax.sharding.PartitionSpec(*tokens_spec, None))(
                           embedding_VxD, tokens_BxS)


def take_at(x_BxSx_, at_B):
  """x[b, at_B[b]] for every row b, the sequence axis kept: [B, 1, ...]."""
  return jnp.take_along_axis(x_BxSx_, at_B.reshape((-1, 1) + (1,) * (x_BxSx_.ndim - 2)), axis=1)


class Attention(nn.Module):
  """Causal grouped-query attention. Without a cache, query t sees keys s <= t of its own
  segment (packed documents never attend to each other). With a cache, the new keys are written
  at `positions` and query t sees cache slots s <= t: stale slots past a row's length are never
  read before being overwritten, which is what makes rollback-by-length decoding exact. With a
  cache and segment ids, the window is a tree of drafts (`mtp_jax.decoding.tree`): written at slots
  positions[:, 0] + s, each query seeing the slots before them and the window tokens its
  segment id's bits name.
  The kernel is `args.attention_impl` (mtp_jax.attention: einsum, cpu, xla, cudnn, splash, auto).
  Model families: q/k/v biases (qkv_bias, Qwen2), RMSNorm over head_dim on q and k before RoPE
  (qk_norm, Qwen3), head_dim apart from d_model / n_heads, RoPE scaling, a sliding window.

  `at_B` (with a cache; [B] window indices): keys and values of all S tokens are computed and
  written, the query of window token at_B alone is answered ([B, 1, D]), as it sees the keys
  (a tree's node: the slots before the window and its ancestors). Parallel heads' drafting
  blocks, whose output is read at one slot of a decoding window (`heads.Drafting.slot_B`)."""
  args: ModelArgs

  @nn.compact
  def __call__(self, x_BxSxD, positions_BxS, segment_ids_BxS=None, cache: Cache | None = None,
               at_B=None):
    a = self.args
    H, K, E = a.n_heads, a.n_kv_heads, a.head_dim
    specs = [((H, E), ("embed", "heads", "head_dim"), "wq"),
             ((K, E), ("embed", "kv_heads", "head_dim"), "wk"),
             ((K, E), ("embed", "kv_heads", "head_dim"), "wv")]
    proj = lambda x, specs: projections(self, x, specs, a.qkv_bias, a.dtype, fuse_projections(a),
                                        dot=dot_general(a))
    q_pos_BxS, mask_pos_BxS, q_seg_BxS = positions_BxS, positions_BxS, segment_ids_BxS
    if at_B is None:
      q_BxSxHxE, k_BxSxKxE, v_BxSxKxE = proj(x_BxSxD, specs)
    else:  # one query per row: its position, and (a tree) its mask, the window's first slot
      assert cache is not None, "Attention: at_B needs a cache"
      if segment_ids_BxS is not None and a.sliding_window:
        raise NotImplementedError("Attention: at_B with a tree window and a sliding window")
      k_BxSxKxE, v_BxSxKxE = proj(x_BxSxD, specs[1:])
      (q_BxSxHxE,) = proj(take_at(x_BxSxD, at_B), specs[:1])
      q_pos_BxS = mask_pos_BxS = take_at(positions_BxS, at_B)
      if segment_ids_BxS is not None:
        mask_pos_BxS, q_seg_BxS = positions_BxS[:, :1], take_at(segment_ids_BxS, at_B)
    if a.qk_norm:  # Qwen3: per-head RMSNorm of q and k, before RoPE
      q_BxSxHxE = rms_norm(q_BxSxHxE, norm_param(self, "q_norm", E), a.norm_eps)
      k_BxSxKxE = rms_norm(k_BxSxKxE, norm_param(self, "k_norm", E), a.norm_eps)
    inv_freq, attention_factor = rope_frequencies(a)
    once = lambda pos: cache is None or pos.size > 1  # one token of one row: no identity dot
    q_BxSxHxE = rope(q_BxSxHxE, q_pos_BxS, inv_freq, attention_factor, once(q_pos_BxS))
    k_BxSxKxE = rope(k_BxSxKxE, positions_BxS, inv_freq, attention_factor, once(positions_BxS))

    if cache is None:
      k_BxTxKxE, v_BxTxKxE = k_BxSxKxE, v_BxSxKxE
      new_cache = None
    else:
      B, S = x_BxSxD.shape[:2]
      rows_Bx1 = jnp.arange(B)[:, None]
      # A tree of drafts (segment ids with a cache: attention.attend) sits in consecutive slots
      # from positions[:, 0], its nodes' positions being their depths; a chain at its positions.
      slots_BxS = (positions_BxS if segment_ids_BxS is None
                   else positions_BxS[:, :1] + jnp.arange(S))
      write = backends.current().cache_write
      k_BxTxKxE, v_BxTxKxE = (write(cache[n], x, rows_Bx1, slots_BxS)
                              for n, x in (("k", k_BxSxKxE), ("v", v_BxSxKxE)))
      new_cache = {"k": k_BxTxKxE, "v": v_BxTxKxE}
    out_BxSxHxE = attention.attend(
        q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, mask_pos_BxS, q_seg_BxS,
        cached=cache is not None, impl=a.attention_impl, dtype=a.dtype, window=a.sliding_window,
        kv_heads_major=cache is not None)
    out_BxSxD = tokens_2d(nn.DenseGeneral(
        a.d_model, axis=(-2, -1), use_bias=False, dtype=a.dtype, dot_general=dot_general(a),
        kernel_init=dense_init(("heads", "head_dim", "embed")), name="wo"))(out_BxSxHxE)
    return out_BxSxD, new_cache


class SwiGLU(nn.Module):
  args: ModelArgs

  @nn.compact
  def __call__(self, x_BxSxD):
    a = self.args
    specs = [((a.d_ff,), ("embed", "mlp"), "w1"), ((a.d_ff,), ("embed", "mlp"), "w3")]
    dot = dot_general(a)
    down = nn.Dense(a.d_model, use_bias=False, dtype=a.dtype, dot_general=dot,
                    kernel_init=dense_init(("mlp", "embed")), name="w2")
    if not fuse_projections(a):
      gate_BxSxF, up_BxSxF = projections(self, x_BxSxD, specs, False, a.dtype, False, dot=dot)
      return tokens_2d(down)(nn.silu(gate_BxSxF) * up_BxSxF)
    gate_up_TxF2 = projections(self, x_BxSxD, specs, False, a.dtype, True, joined=True, dot=dot)
    gated_TxF = backends.current().silu_gate(gate_up_TxF2)
    return down(gated_TxF).reshape(*x_BxSxD.shape[:2], a.d_model)


class Block(nn.Module):
  """Pre-norm transformer block (Llama): x + Attn(norm(x)), then + SwiGLU(norm(x)).
  Signature fits nn.scan (carry first) and nn.vmap alike; returns (x, new_cache)."""
  args: ModelArgs

  @nn.compact
  def __call__(self, x_BxSxD, positions_BxS, segment_ids_BxS=None, cache=None, at_B=None):
    """`at_B`: keys and values of every token written, the rest at window token at_B alone
    ([B, 1, D] out; `Attention`)."""
    a = self.args
    h, new_cache = Attention(a, name="attention")(
        RMSNorm(a.norm_eps, a.dtype, name="attention_norm")(x_BxSxD), positions_BxS,
        segment_ids_BxS, cache, at_B)
    if at_B is not None:
      x_BxSxD = take_at(x_BxSxD, at_B)
    x_BxSxD = x_BxSxD + h
    x_BxSxD = x_BxSxD + SwiGLU(a, name="feed_forward")(
        RMSNorm(a.norm_eps, a.dtype, name="ffn_norm")(x_BxSxD))
    # The residual stream between blocks: rows sharded like the batch, model width whole, so
    # GSPMD does not carry an FSDP weight sharding over into activations. A no-op unless traced
    # inside sharding.activation_rules (one device, tests).
    return sharding.constrain(x_BxSxD, ("batch", "seq", None)), new_cache


def init_cache(args: ModelArgs, n_blocks: int, batch: int, length: int, dtype=jnp.float32):
  """Zeroed KV cache for `n_blocks` stacked blocks: {"k", "v"} of [n_blocks, B, K, L, E],
  heads-major, the layout the cpu attention kernel multiplies (attention.cpu_attention): a
  decoding step then reads each layer's cache in place instead of transposing all of it."""
  shape = (n_blocks, batch, args.n_kv_heads, length, args.head_dim)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
