"""Projection heads: head 1 is the trunk, heads 2..n residual MLPs on the trunk state."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from mtp_jax.heads.base import HeadKind, Shared, register
from mtp_jax.layers import RMSNorm, dense_init, dot_general, rms_norm, tokens_2d
from mtp_jax.model_args import ModelArgs

class ResidualMLP(nn.Module):
  """A light head: z + Linear(2d, d)(SiLU(Linear(d, 2d)(RMSNorm(z))))."""
  args: ModelArgs

  @nn.compact
  def __call__(self, z_BxSxD):
    a = self.args
    y = RMSNorm(a.norm_eps, a.dtype, name="norm")(z_BxSxD)

    def mlp(y_TxD):
      dot = dot_general(a)
      y_TxF = nn.Dense(2 * a.d_model, use_bias=False, dtype=a.dtype, dot_general=dot,
                       kernel_init=dense_init(("embed", "mlp")), name="up")(y_TxD)
      return nn.Dense(a.d_model, use_bias=False, dtype=a.dtype, dot_general=dot,
                      kernel_init=dense_init(("mlp", "embed")), name="down")(nn.silu(y_TxF))
    return z_BxSxD + tokens_2d(mlp)(y)  # one token axis: XLA:CPU's fast weight gradient


@register("projection")
class ProjectionHeads(HeadKind):
  """Head 1 is the trunk itself; heads 2..n are residual MLPs (vmapped, stacked params) on the
  trunk state; all heads share the final norm and the unembedding. No attention, no cache."""
  stacks = {"mlps": 2}
  drafts_tree = True

  @classmethod
  def warm_start(cls, fresh: dict, args: ModelArgs) -> None:
    """Zero output projections: every extra head starts as the identity on the trunk state."""
    fresh["mlps"]["down"]["kernel"][...] = 0

  @classmethod
  def flops_per_token(cls, m, block: int) -> tuple[int, int]:
    d = m.d_model  # n_future - 1 residual MLPs d -> 2d -> d, no attention
    return (m.n_future - 1) * 2 * (d * 2 * d + 2 * d * d), 0

  @nn.compact
  def __call__(self, z_BxSxD, s: Shared, cache=None):
    a = self.args
    h_NxBxSxD = z_BxSxD[None]  # head 1 (phase "first": alone)
    if a.n_future > 1 and s.phase != "first":
      mlps = nn.vmap(ResidualMLP, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=None, out_axes=0, axis_size=a.n_future - 1,
                     metadata_params={nn.PARTITION_NAME: "mtp_heads"})
      rest_K1xBxSxD = mlps(a, name="mlps")(z_BxSxD)
      h_NxBxSxD = (rest_K1xBxSxD if s.phase == "rest" else
                   jnp.concatenate([h_NxBxSxD, rest_K1xBxSxD], axis=0))
    return rms_norm(h_NxBxSxD, s.norm_D, a.norm_eps), cache
