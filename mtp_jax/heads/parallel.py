"""Parallel heads (Gloeckle et al. 2024 §2): n_future transformer blocks on the same trunk state."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtp_jax.heads.base import HeadKind, Shared, register
from mtp_jax.layers import Block, init_cache, remat, rms_norm
from mtp_jax.model_args import ModelArgs

SPLIT = "split"  # parallel_stack of the decoding layout (ParallelHeads.decode_layout)

@register("parallel")
class ParallelHeads(HeadKind):
  """Gloeckle et al. 2024 §2 and Meta's released layout: n_future transformer blocks (head 1 is
  the last block of an n_layers-deep next-token model) with stacked params, applied by nn.vmap
  to the same trunk state (before the final norm), then one shared final norm. Each head block
  keeps its own KV cache when decoding."""
  stacks = {"blocks": 1}
  # "vmap" runs the head blocks side by side; "scan" one at a time (same params).
  choices = {"parallel_stack": ("vmap", "scan")}
  drafts_tree = True
  checkpoint_layouts = {"meta": {}}  # Meta's multi-token-prediction release: extra_heads
  # Decoding (split layout, phase "rest"): heads 2..k answer the query at Drafting.slot_B alone;
  # False: every window token (experiments/parallel_cycle.py's reference).
  read_at_slot = True

  @classmethod
  def n_trunk(cls, m) -> int:
    return m.n_layers - m.n_future  # matched parameters: the heads take the last blocks

  @classmethod
  def cache_blocks(cls, args: ModelArgs) -> int:
    return args.n_future

  @classmethod
  def warm_start(cls, fresh: dict, args: ModelArgs) -> None:
    """Every extra head block starts as a copy of head 1's (Meta's layout: the last layer)."""
    for x in jax.tree.leaves(fresh["blocks"]):
      x[1:] = x[0]

  @classmethod
  def flops_per_token(cls, m, block: int) -> tuple[int, int]:
    return m.n_future * block, m.n_future  # n_future blocks taken from n_layers

  @classmethod
  def validate_config(cls, m, fail) -> None:
    if m.n_future > m.n_layers:
      fail("model.n_future", f"parallel heads take their blocks from the trunk, so n_future "
           f"must be <= model.n_layers ({m.n_layers}), got {m.n_future}")

  @classmethod
  def decode_layout(cls, params, args: ModelArgs):
    """Decoding splits head 1's block ("first") from the drafting heads' stack ("blocks", heads
    2..k), once: head 1 verifies every window token (phase "first"), heads 2..k run their full
    block at one slot (phase "rest", `Drafting.slot_B`). parallel_stack "split" (a decoding
    layout, not a config choice)."""
    if args.n_future < 2 or args.parallel_stack == SPLIT:
      return params, args
    stacked = params["heads"]["blocks"]
    split = {"first": jax.tree.map(lambda x: x[0], stacked),
             "blocks": jax.tree.map(lambda x: x[1:], stacked)}
    return {**params, "heads": split}, dataclasses.replace(args, parallel_stack=SPLIT)

  @classmethod
  def decode_cache(cls, args: ModelArgs, batch: int, length: int, dtype):
    """Split (`decode_layout`): [head 1's cache, heads 2..k's], each with a blocks axis."""
    if args.parallel_stack != SPLIT:
      return super().decode_cache(args, batch, length, dtype)
    return [init_cache(args, n, batch, length, dtype) for n in (1, args.n_future - 1)]

  @nn.compact
  def __call__(self, z_BxSxD, s: Shared, cache=None):
    a = self.args
    lifted = dict(variable_axes={"params": 0}, split_rngs={"params": True},
                  metadata_params={nn.PARTITION_NAME: "mtp_heads"})
    if a.parallel_stack == SPLIT:
      return self.split(z_BxSxD, s, cache, lifted)
    if s.phase is not None and a.n_future > 1:  # (with one head, "first" is the whole forward)
      raise ValueError("parallel heads decode in two phases in their decoding layout "
                       "(ParallelHeads.decode_layout, model.unrolled)")
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

  def split(self, z_BxSxD, s: Shared, cache, lifted):
    """The decoding layout (`decode_layout`): head 1's block over every token (phase "first"),
    then heads 2..k's side by side (phase "rest"), at `s.drafting.slot_B` alone when the decoder
    gives one (their keys and values still written for every token), their states broadcast
    over the window. Phase None: both."""
    a = self.args
    pos, seg = s.positions_BxS, s.segment_ids_BxS
    c1, cs = (None, None) if cache is None else cache
    if s.phase != "rest":
      h1_BxSxD, c1_new = remat(Block, a.remat_policy)(a, name="first")(
          z_BxSxD, pos, seg, None if c1 is None else jax.tree.map(lambda c: c[0], c1))
      h1_BxSxD = rms_norm(h1_BxSxD, s.norm_D, a.norm_eps)
      c1 = None if cache is None else jax.tree.map(lambda c: c[None], c1_new)
      if s.phase == "first":
        return h1_BxSxD[None], None if cache is None else [c1, cs]
    at_B = None
    if (cache is not None and s.drafting is not None and self.read_at_slot
        and not (seg is not None and a.sliding_window)):  # (Attention's at_B: not both)
      at_B = s.drafting.slot_B.astype(jnp.int32)
    blocks = nn.vmap(remat(Block, a.remat_policy), in_axes=(None, None, None, 0, None),
                     out_axes=0, axis_size=a.n_future - 1, **lifted)
    h_K1xBxSxD, cs = blocks(a, name="blocks")(z_BxSxD, pos, seg, cs, at_B)
    h_K1xBxSxD = rms_norm(h_K1xBxSxD, s.norm_D, a.norm_eps)
    if at_B is not None:
      h_K1xBxSxD = jnp.broadcast_to(h_K1xBxSxD, (a.n_future - 1,) + z_BxSxD.shape)
    new_cache = None if cache is None else [c1, cs]
    if s.phase == "rest":
      return h_K1xBxSxD, new_cache
    return jnp.concatenate([h1_BxSxD[None], h_K1xBxSxD]), new_cache
