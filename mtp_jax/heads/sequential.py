"""Sequential heads (DeepSeek-V3 MTP, arXiv 2412.19437 §2.2): a causal chain of depths after the
trunk, and what the depths read while decoding (`known_tokens`, `draft_tokens`)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.heads.base import Drafting, HeadKind, Shared, head_logits, register
from mtp_jax.layers import (Block, RMSNorm, dense_init, dot_general, embed_lookup, remat, rms_norm,
                            tokens_2d)
from mtp_jax.model_args import ModelArgs

class Depth(nn.Module):
  """One DeepSeek-V3 MTP module (arXiv 2412.19437 eq. 21-23), scanned over depths k = 1..n-1:
  h'_k = eh_proj([enorm(Emb(x_{t+k})); hnorm(h_{k-1})]), h_k = Block(h'_k), and
  P_{k+1} = unembed(out_norm(h_k)). The concatenation order, the output norm (own
  `shared_head_norm` or the main one) are config fields; see SequentialHeads.presets for who
  does which.

  Teacher forcing (training): the depth's token embeddings come in as the scanned input.
  Decoding (`Shared.decoding`): the scanned input is (known_BxS, u_B): depth k reads the known
  token x_{t+k} where the decoder has it (`Drafting.after_BxS`: prompt, accepted tokens), else
  the draft of depth k-1 at the same position (drawn with the row's uniform u_B by
  `Drafting.pick`, argmax without one), so one forward drafts n-1 chained tokens at the last
  accepted position."""
  args: ModelArgs

  @nn.compact
  def __call__(self, carry, emb_BxSxD, cache, s: Shared):
    a = self.args
    h_prev_BxSxD, tok_BxS = carry
    if s.decoding:
      known_BxS, u_B = emb_BxSxD
      tok_BxS = jnp.where(known_BxS >= 0, known_BxS, tok_BxS)
      emb_BxSxD = embed_lookup(s.embed_VxD, tok_BxS, a.dtype)
    e = RMSNorm(a.norm_eps, a.dtype, name="enorm")(emb_BxSxD)
    h = RMSNorm(a.norm_eps, a.dtype, name="hnorm")(h_prev_BxSxD)
    cat = [e, h] if a.seq_concat == "emb_first" else [h, e]
    eh_proj = nn.Dense(a.d_model, use_bias=False, dtype=a.dtype, dot_general=dot_general(a),
                       kernel_init=dense_init(("concat", "embed")), name="eh_proj")
    x_BxSxD = tokens_2d(eh_proj)(jnp.concatenate(cat, axis=-1))  # one token axis (layers)
    h_BxSxD, new_cache = remat(Block, a.remat_policy)(a, name="block")(
        x_BxSxD, s.positions_BxS, s.segment_ids_BxS, cache)
    if a.seq_output_norm == "per_module":
      out_BxSxD = RMSNorm(a.norm_eps, a.dtype, name="shared_head_norm")(h_BxSxD)
    else:
      out_BxSxD = rms_norm(h_BxSxD, s.norm_D, a.norm_eps)
    if s.decoding:
      if s.drafting is None:
        tok_BxS = jnp.argmax(out_BxSxD.astype(jnp.float32) @ s.unembed_DxV, axis=-1)
      else:
        w_DxV = s.unembed_DxV if s.drafting.unembed_DxV is None else s.drafting.unembed_DxV
        tok_BxS = draft_at(s.drafting, u_B, out_BxSxD, w_DxV)
      tok_BxS = tok_BxS.astype(jnp.int32)
    return (h_BxSxD, tok_BxS), (out_BxSxD, new_cache)


def shift_left(x_BxSx_, k: int):
  """x[:, t + k] at position t, zeros past the end (those positions have no target)."""
  pad = jnp.zeros_like(x_BxSx_[:, :k])
  return jnp.concatenate([x_BxSx_[:, k:], pad], axis=1)


@register("sequential")
class SequentialHeads(HeadKind):
  """DeepSeek-V3 MTP: head 1 is the trunk (final norm + shared unembedding); depths 1..n-1 are
  a causal chain of `Depth` modules, nn.scan over stacked params. Depth k at position t sees
  x_{<=t+k} and predicts x_{t+k+1}, i.e. it is head k+1.

  Where public implementations disagree, a config field chooses (`presets` names who does
  which): the concatenation order, the trunk state before or after the final norm, and each
  depth's own output norm or the main one."""
  stacks = {"depths": 2}
  choices = {"seq_concat": ("emb_first", "hidden_first"),
             "seq_trunk_state": ("post_norm", "pre_norm"),
             "seq_output_norm": ("per_module", "shared")}
  preset_field = "seq_preset"
  # DeepSeek-V3's MTP layers (model.layers.{n_trunk + k}) hold depth k.
  checkpoint_layouts = {"deepseek": {"seq_preset": "deepseek_v3"}}
  presets = {
      # The released DeepSeek-V3 weights, Megatron, vLLM, SGLang: eh_proj([enorm(emb);
      # hnorm(h)]), h taken after the main model's final norm, `shared_head.norm` per module.
      "deepseek_v3": dict(seq_concat="emb_first", seq_trunk_state="post_norm",
                          seq_output_norm="per_module"),
      # The paper's eq. 21 ([h; emb]) as MiMo writes it.
      "paper": dict(seq_concat="hidden_first", seq_trunk_state="post_norm",
                    seq_output_norm="per_module"),
      # MaxText: trunk state before the final norm, the main model's norm reused for every
      # depth.
      "maxtext": dict(seq_concat="emb_first", seq_trunk_state="pre_norm",
                      seq_output_norm="shared"),
  }

  @classmethod
  def warm_start(cls, fresh: dict, args: ModelArgs) -> None:
    """Each depth's block adds nothing (zero attention and MLP output projections) and eh_proj
    passes the previous hidden state through, so depth k starts out predicting what head 1
    predicts, not noise."""
    d = fresh["depths"]
    d["block"]["attention"]["wo"]["kernel"][...] = 0
    d["block"]["feed_forward"]["w2"]["kernel"][...] = 0
    eh = d["eh_proj"]["kernel"]  # [depths, 2D, D]: rows of [emb; h] or [h; emb]
    eh[...] = 0
    h_rows = slice(args.d_model, None) if args.seq_concat == "emb_first" else slice(0, args.d_model)
    eh[:, h_rows] = np.eye(args.d_model, dtype=eh.dtype)

  @classmethod
  def cache_blocks(cls, args: ModelArgs) -> int:
    return args.n_future - 1

  @classmethod
  def flops_per_token(cls, m, block: int) -> tuple[int, int]:
    d = m.d_model  # n_future - 1 depths (arXiv 2412.19437 eq. 21-23): eh_proj 2d -> d, a block
    return (m.n_future - 1) * (2 * (2 * d * d) + block), m.n_future - 1

  @nn.compact
  def __call__(self, z_BxSxD, s: Shared, cache=None):
    a = self.args
    h1_BxSxD = rms_norm(z_BxSxD, s.norm_D, a.norm_eps)
    if a.n_future == 1 or s.phase == "first":
      return h1_BxSxD[None], cache
    h0_BxSxD = h1_BxSxD if a.seq_trunk_state == "post_norm" else z_BxSxD
    D = a.n_future - 1
    tok_BxS = jnp.zeros(z_BxSxD.shape[:2], jnp.int32)
    if s.decoding and s.drafting is None:  # depth 1 reads head 1's argmax, deeper depths drafts
      first_BxS = jnp.argmax(h1_BxSxD.astype(jnp.float32) @ s.unembed_DxV, axis=-1)
      known_DxBxS = jnp.full((D,) + tok_BxS.shape, -1, jnp.int32).at[0].set(first_BxS)
      emb_DxBxSxD = (known_DxBxS, None)
    elif s.decoding:
      d = s.drafting
      emb_DxBxSxD = (known_tokens(d.after_BxS, d.slot_B, D), d.u_DxB)
    else:
      emb_DxBxSxD = jnp.stack([shift_left(s.x_BxSxD, k) for k in range(1, D + 1)])
    depths = nn.scan(Depth, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=(0, 0, nn.broadcast), length=D,
                     metadata_params={nn.PARTITION_NAME: "mtp_heads"})
    _, (out_DxBxSxD, new_cache) = depths(a, name="depths")(
        (h0_BxSxD.astype(a.dtype), tok_BxS), emb_DxBxSxD, cache, s)
    out_DxBxSxD = out_DxBxSxD.astype(h1_BxSxD.dtype)
    if s.phase == "rest":
      return out_DxBxSxD, new_cache
    return jnp.concatenate([h1_BxSxD[None], out_DxBxSxD]), new_cache


# What the depths read while decoding: the tokens that are known (prompt, accepted drafts, the new
# token) and, beyond them, their own drafts.

def known_tokens(after_BxS, last_B, depths: int) -> jax.Array:
  """[depths, B, S]: what sequential depth d reads at position s, x_{s+d}, where it is known
  (after[s + d - 1] for s + d - 1 <= last; after[s] is the token after position s), else -1."""
  B, S = after_BxS.shape
  s_S = jnp.arange(S)
  out = []
  for d in range(1, depths + 1):
    idx_S = s_S + d - 1
    tok_BxS = jnp.take(after_BxS, jnp.minimum(idx_S, S - 1), axis=1)
    out.append(jnp.where(idx_S[None] <= last_B[:, None], tok_BxS, -1))
  return jnp.stack(out).astype(jnp.int32)


def draft_tokens(out_BxSxD, unembed_DxV, pick=None, u_B=None) -> jax.Array:
  """[B, S] drafts of one head: its argmax (pick None), or pick(logits_BxSxV, u_BxS), the
  decoder's draw with the row's uniform."""
  lg_BxSxV = head_logits(out_BxSxD, unembed_DxV)
  if pick is None:
    return jnp.argmax(lg_BxSxV, axis=-1).astype(jnp.int32)
  return pick(lg_BxSxV, jnp.broadcast_to(u_B[:, None], lg_BxSxV.shape[:2]))


def draft_at(d: Drafting, u_B, out_BxSxD, unembed_DxV) -> jax.Array:
  """[B, S] drafts of one depth where the decoder reads them (`Drafting.slots_BxN`; None: every
  position), drawn by `Drafting.pick` with the row's uniform u_B (argmax without pick), 0
  elsewhere; so a long prompt is not unembedded at every position."""
  if d.slots_BxN is None:
    return draft_tokens(out_BxSxD, unembed_DxV, d.pick, u_B)
  out_BxNxD = jnp.take_along_axis(out_BxSxD, d.slots_BxN[..., None], axis=1)
  rows_Bx1 = jnp.arange(out_BxSxD.shape[0])[:, None]
  return jnp.zeros(out_BxSxD.shape[:2], jnp.int32).at[rows_Bx1, d.slots_BxN].set(
      draft_tokens(out_BxNxD, unembed_DxV, d.pick, u_B))
