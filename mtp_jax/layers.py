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

from mtp_jax import attention, cpu_gemm, sharding
from mtp_jax.model_args import ModelArgs

Cache = dict[str, jax.Array]  # {"k": [B, K, L, E], "v": [B, K, L, E]}, heads-major


def dense_init(axes):
  """LeCun-normal (1/sqrt(fan_in)) init with logical axis names."""
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)


def one_cpu_device() -> bool:
  """Whether this trace compiles for a single CPU device: the mesh in context (its devices may
  be abstract), else the default backend's devices (static: called while tracing). What the CPU
  choices (`fuse_projections`, `scan_unroll` auto) key on."""
  mesh = jax.sharding.get_abstract_mesh()
  devices = jax.device_count() if mesh.empty else mesh.size
  return attention.target_platform() == "cpu" and devices == 1


def fuse_projections(a: ModelArgs) -> bool:
  """model.fuse_projections resolved: "on", "off", or for "auto" `one_cpu_device()`."""
  return a.fuse_projections == "on" or (a.fuse_projections == "auto" and one_cpu_device())


def dot_general(a: ModelArgs):
  """model.cpu_matmul resolved to the dot_general the dense layers and the loss take, for a
  trace compiled for one CPU device: `cpu_gemm.dot_general` (MKL's sgemm for float32 products
  of many rows) for "mkl", and for "auto" on an Intel CPU where MKL is at hand, unless a remat
  policy saves dots (it would not know MKL's custom call for one, and recompute it);
  lax.dot_general for "xla" and on every other target (a mesh, an accelerator). Static: called
  while tracing."""
  if a.cpu_matmul == "xla" or not one_cpu_device():
    return lax.dot_general
  if a.cpu_matmul == "auto":
    mkl = (cpu_gemm.intel_cpu() and not a.remat_policy.startswith("dots")
           and cpu_gemm.available())
    return cpu_gemm.dot_general if mkl else lax.dot_general
  if not cpu_gemm.available():  # validation says so first; a config built past it lands here
    raise ValueError(f"model.cpu_matmul: mkl is not available here: "
                     f"{cpu_gemm.unavailable_reason()} (auto or xla are)")
  return cpu_gemm.dot_general


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


@jax.custom_vjp
def silu_gate(gate_up_TxF2):
  """silu(gate) * up of [gate | up] side by side (SwiGLU's fused w1, w3 projection), with the
  gradient written back side by side: one elementwise pass of sigmoid(gate) reading gate, up
  and the output's cotangent, writing [d gate | d up] that the fused projection's backward
  GEMMs read as is. Autodiff's version took five passes on XLA:CPU (silu's derivative,
  the products, then a copy to concatenate the two halves). Same maths."""
  gate, up = jnp.split(gate_up_TxF2, 2, axis=-1)
  return nn.silu(gate) * up


def _silu_gate_fwd(gate_up_TxF2):
  return silu_gate(gate_up_TxF2), gate_up_TxF2


def _silu_gate_bwd(gate_up_TxF2, d_out_TxF):
  """[d gate | d up] as one elementwise pass over a [T, 2, F] view: both halves read gate, up
  and the cotangent broadcast over the middle axis and each writes its own formula, so XLA:CPU
  fuses it into ONE loop writing the side-by-side gradient (sigmoid(gate) being the forward's,
  which XLA keeps). Before, as [d gate, d up] concatenated: two fusions and a concatenate of
  their outputs (with the sigmoid's fusion, 10.7 ms a layer of the default model's n_future 1
  step on one core of the model-167 Xeon); now the step is 1.02x faster on two cores
  (docs/cpu_speed.md). The same values to the last bit."""
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


def projections(module: nn.Module, x_BxSxD, specs, use_bias: bool, dtype, fused: bool,
                joined: bool = False, dot=lax.dot_general):
  """One projection of x per (features, logical axes, name) in `specs`, each a child named
  `name` with DenseGeneral's params: as one matmul (`fused_dense`) or one DenseGeneral each.
  `joined` (fused only): the one matmul's [B*S, sum of widths] output, not split."""
  B, S, D = x_BxSxD.shape
  if fused:
    params = [DenseParams(f, axes, use_bias, parent=module, name=name)(D)
              for f, axes, name in specs]
    ys = fused_dense(x_BxSxD.reshape(B * S, D), params, dtype, split=not joined, dot=dot)
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
  """The f32 tables, computed once and read by every consumer. XLA:CPU fuses a cheap producer
  into each consumer, so the [B, S, 1, E/2] sin and cos tables of RoPE were evaluated again for
  every head of every rope and rope gradient (48 fusions of a 6-layer train step, ~3% of it on
  an AVX-512 Xeon), and it expands `optimization_barrier` before fusing. A dot is never fused
  into its consumers: the tables, side by side, times the identity matrix are written once,
  and exactly (each output is one product by 1.0 plus products by 0.0). Elsewhere (TPU dots
  round f32 inputs by default) the barrier, which those compilers keep."""
  if attention.target_platform() != "cpu":
    return jax.lax.optimization_barrier(tables_Bx_xF)
  F = tables_Bx_xF[0].shape[-1]
  both = jnp.concatenate(tables_Bx_xF, axis=-1)
  both = jnp.einsum("...f,fg->...g", both, jnp.eye(both.shape[-1], dtype=both.dtype),
                    precision=jax.lax.Precision.HIGHEST)
  return tuple(both[..., i * F:(i + 1) * F] for i in range(len(tables_Bx_xF)))


def rope(x_BxSxHxE, positions_BxS, inv_freq: np.ndarray, attention_factor: float = 1.0,
         once: bool = True):
  """Rotary embedding, rotate-half layout (HF Llama); Meta's interleaved-pair checkpoints need
  their q/k rows permuted on import. `inv_freq` from `rope_frequencies` (model.rope_scaling).
  `once`: the sin and cos tables through `written_once`; a batch-1 decoding step (one token)
  passes False, since there one identity dot per rope, 6 of the step's ~110 ops for the default
  model, costs more than evaluating its few sines again in each consumer (at batch 8 the sines
  of every head cost more: 0.91x measured). Same values."""
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
  (measured: SwiGLU backward 2x faster)."""
  def wrapped(x_BxSx_, *args):
    B, S = x_BxSx_.shape[:2]
    y = fn(x_BxSx_.reshape(B * S, *x_BxSx_.shape[2:]), *args)
    return y.reshape(B, S, *y.shape[1:])
  return wrapped


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
  (qk_norm, Qwen3), head_dim apart from d_model / n_heads, RoPE scaling, a sliding window."""
  args: ModelArgs

  @nn.compact
  def __call__(self, x_BxSxD, positions_BxS, segment_ids_BxS=None, cache: Cache | None = None):
    a = self.args
    H, K, E = a.n_heads, a.n_kv_heads, a.head_dim
    q_BxSxHxE, k_BxSxKxE, v_BxSxKxE = projections(
        self, x_BxSxD, [((H, E), ("embed", "heads", "head_dim"), "wq"),
                        ((K, E), ("embed", "kv_heads", "head_dim"), "wk"),
                        ((K, E), ("embed", "kv_heads", "head_dim"), "wv")],
        a.qkv_bias, a.dtype, fuse_projections(a), dot=dot_general(a))
    if a.qk_norm:  # Qwen3: per-head RMSNorm of q and k, before RoPE
      q_BxSxHxE = rms_norm(q_BxSxHxE, norm_param(self, "q_norm", E), a.norm_eps)
      k_BxSxKxE = rms_norm(k_BxSxKxE, norm_param(self, "k_norm", E), a.norm_eps)
    inv_freq, attention_factor = rope_frequencies(a)
    once = cache is None or positions_BxS.size > 1  # one token of one row: no identity dot
    q_BxSxHxE = rope(q_BxSxHxE, positions_BxS, inv_freq, attention_factor, once)
    k_BxSxKxE = rope(k_BxSxKxE, positions_BxS, inv_freq, attention_factor, once)

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
      k_BxTxKxE, v_BxTxKxE = (_cache_write(cache[n], x, rows_Bx1, slots_BxS)
                              for n, x in (("k", k_BxSxKxE), ("v", v_BxSxKxE)))
      new_cache = {"k": k_BxTxKxE, "v": v_BxTxKxE}
    out_BxSxHxE = attention.attend(
        q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxS, segment_ids_BxS,
        cached=cache is not None, impl=a.attention_impl, dtype=a.dtype, window=a.sliding_window,
        kv_heads_major=cache is not None)
    out_BxSxD = tokens_2d(nn.DenseGeneral(
        a.d_model, axis=(-2, -1), use_bias=False, dtype=a.dtype, dot_general=dot_general(a),
        kernel_init=dense_init(("heads", "head_dim", "embed")), name="wo"))(out_BxSxHxE)
    return out_BxSxD, new_cache


def _cache_write(cache_BxKxTxE, new_BxSxKxE, rows_Bx1, slots_BxS):
  """The cache (heads-major, [B, K, T, E]) with the new keys or values written at (row, slot),
  one scatter that XLA updates in place: (rows, slots) index [B, S] and the slice keeps K, so
  the update is [B, S, K, E], the new keys as they are. A single (row, slot) (one token at
  batch 1) is written twice, the same value at the same place: XLA turns a one-index scatter
  into a dynamic-update-slice and fuses that into every reader of the cache, each on a copy of
  its own (about five copies of each cache per token), where a scatter stays one in-place
  write. Duplicate indices of a scatter land in any order; here both hold the same value. On
  XLA:CPU only (XLA:TPU's estimate of a batch-1 step grew 8% with it)."""
  new_BxSxKxE = new_BxSxKxE.astype(cache_BxKxTxE.dtype)
  if rows_Bx1.shape[0] * slots_BxS.shape[1] == 1 and attention.target_platform() == "cpu":
    rows_Bx1 = jnp.concatenate([rows_Bx1, rows_Bx1], axis=1)
    slots_BxS, new_BxSxKxE = (jnp.concatenate([x, x], axis=1) for x in (slots_BxS, new_BxSxKxE))
  return cache_BxKxTxE.at[rows_Bx1, :, slots_BxS].set(new_BxSxKxE)


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
    return down(silu_gate(gate_up_TxF2)).reshape(*x_BxSxD.shape[:2], a.d_model)


class Block(nn.Module):
  """Pre-norm transformer block (Llama): x + Attn(norm(x)), then + SwiGLU(norm(x)).
  Signature fits nn.scan (carry first) and nn.vmap alike; returns (x, new_cache)."""
  args: ModelArgs

  @nn.compact
  def __call__(self, x_BxSxD, positions_BxS, segment_ids_BxS=None, cache=None):
    a = self.args
    h, new_cache = Attention(a, name="attention")(
        RMSNorm(a.norm_eps, a.dtype, name="attention_norm")(x_BxSxD), positions_BxS,
        segment_ids_BxS, cache)
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
