"""The decoding loops' forward, in two phases inside their one jit (`heads.Shared.phase`):

  first: the trunk and head 1 over the window, writing the trunk's (and head 1's) KV cache;
  the loop reads head 1 and decides itself what the cycle accepts (`decode_loop`, `tree`);
  rest: heads 2..k from the same trunk states, reading what the loop hands them as data
  (`heads.Drafting`: the slot it reads them at, the tokens it now knows, its draw), writing
  their caches.

No head calls back into the loop, and the acceptance rule runs once per cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from mtp_jax.heads import Drafting
from mtp_jax.model import MTPModel


@dataclasses.dataclass(frozen=True)
class Forward:
  """model.apply of a decoding loop's (unrolled) params, phase by phase."""
  model: MTPModel
  params: Any

  @property
  def k(self) -> int:
    return self.model.args.n_future

  def first(self, tokens_BxS, positions_BxS, cache, segment_ids_BxS=None):
    """(h1_BxSxD head 1's normalised states, z_BxSxD the trunk's output, cache)."""
    (h_1xBxSxD, z_BxSxD), cache = self.model.apply(
        {"params": self.params}, tokens_BxS, segment_ids_BxS, positions_BxS=positions_BxS,
        cache=cache, decoding=True, phase="first")
    return h_1xBxSxD[0], z_BxSxD, cache

  def rest(self, tokens_BxS, positions_BxS, cache, z_BxSxD, drafting: Drafting,
           segment_ids_BxS=None):
    """(h_K1xBxSxD heads 2..k's normalised states, read at drafting.slot_B, cache); with one
    head, no states and the cache as it is."""
    if self.k == 1:
      return jax.numpy.zeros((0,) + z_BxSxD.shape, z_BxSxD.dtype), cache
    return self.model.apply(
        {"params": self.params}, tokens_BxS, segment_ids_BxS, positions_BxS=positions_BxS,
        cache=cache, decoding=True, phase="rest", drafting=drafting, trunk_states_BxSxD=z_BxSxD)
