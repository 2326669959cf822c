"""Prediction heads, chosen by `config.model.heads.kind` from a registry.

Every kind maps the trunk state z_BxSxD to h_NxBxSxD, N = n_future: head i (1-based) at
position t predicts x_{t+i}, normalised and ready for the shared unembedding. Head 1 alone is a
next-token model. Heads never produce logits for training: the loss unembeds one head at a time.

Transformed modules (nn.vmap / nn.scan) only touch their own parameters; shared arrays (the
final norm scale, the embedding table) come in as plain arguments, so lifting stays simple.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtp_jax.layers import Block, ModelArgs, RMSNorm, dense_init, remat, rms_norm

HEADS: dict[str, type[nn.Module]] = {}


def register(name: str) -> Callable:
  def wrap(cls):
    HEADS[name] = cls
    return cls
  return wrap


@dataclasses.dataclass(frozen=True)
class Shared:
  """What every head kind may read besides the trunk state. Arrays, not modules."""
  x_BxSxD: jax.Array  # input embeddings (sequential depths shift them for teacher forcing)
  positions_BxS: jax.Array
  segment_ids_BxS: Any  # None or int [B, S]
  norm_D: jax.Array  # the shared final RMSNorm scale
  embed_VxD: jax.Array
  unembed_DxV: jax.Array


def head_cache_blocks(args: ModelArgs) -> int:
  """Number of attention blocks in the heads that need their own KV cache when decoding."""
  return {"parallel": args.n_future, "projection": 0,
          "sequential": args.n_future - 1}[args.head_kind]


@register("parallel")
class ParallelHeads(nn.Module):
  """Gloeckle et al. 2024 §2 and Meta's released layout: n_future transformer blocks (head 1 is
  the last block of an n_layers-deep next-token model) with stacked params, applied by nn.vmap
  to the same trunk state (before the final norm), then one shared final norm. Each head block
  keeps its own KV cache when decoding."""
  args: ModelArgs

  @nn.compact
  def __call__(self, z_BxSxD, s: Shared, cache=None, chain: bool = False):
    del chain
    a = self.args
    lifted = dict(variable_axes={"params": 0}, split_rngs={"params": True},
                  metadata_params={nn.PARTITION_NAME: "mtp_heads"})
    if a.parallel_stack == "vmap":
      blocks = nn.vmap(remat(Block, a.remat_policy), in_axes=(None, None, None, 0), out_axes=0,
                       axis_size=a.n_future, **lifted)
      h_NxBxSxD, new_cache = blocks(a, name="blocks")(z_BxSxD, s.positions_BxS,
                                                      s.segment_ids_BxS, cache)
    else:  # same parameter layout, one head block alive at a time

      def one_head(block, carry, head_cache):
        h_BxSxD, c = block(z_BxSxD, s.positions_BxS, s.segment_ids_BxS, head_cache)
        return carry, (h_BxSxD, c)

      scan = nn.scan(one_head, in_axes=0, length=a.n_future, **lifted)
      _, (h_NxBxSxD, new_cache) = scan(remat(Block, a.remat_policy)(a, name="blocks"), None,
                                       cache)
    return rms_norm(h_NxBxSxD, s.norm_D, a.norm_eps), new_cache


class ResidualMLP(nn.Module):
  """Seed 000's light head: z + Linear(2d, d)(SiLU(Linear(d, 2d)(RMSNorm(z))))."""
  args: ModelArgs

  @nn.compact
  def __call__(self, z_BxSxD):
    a = self.args
    y = RMSNorm(a.norm_eps, a.dtype, name="norm")(z_BxSxD)
    y = nn.Dense(2 * a.d_model, use_bias=False, dtype=a.dtype,
                 kernel_init=dense_init(("embed", "mlp")), name="up")(y)
    y = nn.Dense(a.d_model, use_bias=False, dtype=a.dtype,
                 kernel_init=dense_init(("mlp", "embed")), name="down")(nn.silu(y))
    return z_BxSxD + y


@register("projection")
class ProjectionHeads(nn.Module):
  """Head 1 is the trunk itself; heads 2..n are residual MLPs (vmapped, stacked params) on the
  trunk state; all heads share the final norm and the unembedding. No attention, no cache."""
  args: ModelArgs

  @nn.compact
  def __call__(self, z_BxSxD, s: Shared, cache=None, chain: bool = False):
    del chain
    a = self.args
    h_NxBxSxD = z_BxSxD[None]
    if a.n_future > 1:
      mlps = nn.vmap(ResidualMLP, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=None, out_axes=0, axis_size=a.n_future - 1,
                     metadata_params={nn.PARTITION_NAME: "mtp_heads"})
      h_NxBxSxD = jnp.concatenate([h_NxBxSxD, mlps(a, name="mlps")(z_BxSxD)], axis=0)
    return rms_norm(h_NxBxSxD, s.norm_D, a.norm_eps), cache


class Depth(nn.Module):
  """One DeepSeek-V3 MTP module (arXiv 2412.19437 eq. 21-23), scanned over depths k = 1..n-1:
  h'_k = eh_proj([enorm(Emb(x_{t+k})); hnorm(h_{k-1})]), h_k = Block(h'_k), and
  P_{k+1} = unembed(out_norm(h_k)). The concatenation order, the output norm (own
  `shared_head_norm` or the main one) are config fields; see config.SEQ_PRESETS for who does
  which.

  Teacher forcing (training): the depth's token embeddings come in as the scanned input.
  Chain (decoding): depth k reads the argmax of depth k-1 at the same position, so one forward
  drafts n-1 tokens at the last accepted position (depth 1 reads head 1's own token, exact)."""
  args: ModelArgs
  chain: bool = False

  @nn.compact
  def __call__(self, carry, emb_BxSxD, cache, s: Shared):
    a = self.args
    h_prev_BxSxD, tok_BxS = carry
    if self.chain:
      emb_BxSxD = jnp.take(s.embed_VxD, tok_BxS, axis=0).astype(a.dtype)
    e = RMSNorm(a.norm_eps, a.dtype, name="enorm")(emb_BxSxD)
    h = RMSNorm(a.norm_eps, a.dtype, name="hnorm")(h_prev_BxSxD)
    cat = [e, h] if a.seq_concat == "emb_first" else [h, e]
    x_BxSxD = nn.Dense(a.d_model, use_bias=False, dtype=a.dtype,
                       kernel_init=dense_init(("concat", "embed")),
                       name="eh_proj")(jnp.concatenate(cat, axis=-1))
    h_BxSxD, new_cache = remat(Block, a.remat_policy)(a, name="block")(
        x_BxSxD, s.positions_BxS, s.segment_ids_BxS, cache)
    if a.seq_output_norm == "per_module":
      out_BxSxD = RMSNorm(a.norm_eps, a.dtype, name="shared_head_norm")(h_BxSxD)
    else:
      out_BxSxD = rms_norm(h_BxSxD, s.norm_D, a.norm_eps)
    if self.chain:
      tok_BxS = jnp.argmax(out_BxSxD.astype(jnp.float32) @ s.unembed_DxV, axis=-1)
    return (h_BxSxD, tok_BxS), (out_BxSxD, new_cache)


def shift_left(x_BxSx_, k: int):
  """x[:, t + k] at position t, zeros past the end (those positions have no target)."""
  pad = jnp.zeros_like(x_BxSx_[:, :k])
  return jnp.concatenate([x_BxSx_[:, k:], pad], axis=1)


@register("sequential")
class SequentialHeads(nn.Module):
  """DeepSeek-V3 MTP: head 1 is the trunk (final norm + shared unembedding); depths 1..n-1 are
  a causal chain of `Depth` modules, nn.scan over stacked params. Depth k at position t sees
  x_{<=t+k} and predicts x_{t+k+1}, i.e. it is head k+1."""
  args: ModelArgs

  @nn.compact
  def __call__(self, z_BxSxD, s: Shared, cache=None, chain: bool = False):
    a = self.args
    h1_BxSxD = rms_norm(z_BxSxD, s.norm_D, a.norm_eps)
    if a.n_future == 1:
      return h1_BxSxD[None], cache
    h0_BxSxD = h1_BxSxD if a.seq_trunk_state == "post_norm" else z_BxSxD
    D = a.n_future - 1
    if chain:
      emb_DxBxSxD = None
      tok_BxS = jnp.argmax(h1_BxSxD.astype(jnp.float32) @ s.unembed_DxV, axis=-1)
    else:
      emb_DxBxSxD = jnp.stack([shift_left(s.x_BxSxD, k) for k in range(1, D + 1)])
      tok_BxS = jnp.zeros(z_BxSxD.shape[:2], jnp.int32)
    depths = nn.scan(Depth, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=(0, 0, nn.broadcast), length=D,
                     metadata_params={nn.PARTITION_NAME: "mtp_heads"})
    _, (out_DxBxSxD, new_cache) = depths(a, chain, name="depths")(
        (h0_BxSxD.astype(a.dtype), tok_BxS), emb_DxBxSxD, cache, s)
    return jnp.concatenate([h1_BxSxD[None], out_DxBxSxD.astype(h1_BxSxD.dtype)]), new_cache
