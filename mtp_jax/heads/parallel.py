"""Parallel heads (Gloeckle et al. 2024 §2): n_future transformer blocks on the same trunk state."""

from __future__ import annotations

import flax.linen as nn
import jax

from mtp_jax.heads.base import HeadKind, Shared, register
from mtp_jax.layers import Block, remat, rms_norm
from mtp_jax.model_args import ModelArgs

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

  @nn.compact
  def __call__(self, z_BxSxD, s: Shared, cache=None):
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
