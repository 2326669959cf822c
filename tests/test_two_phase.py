"""The decoding forward in two phases (`heads.Shared.phase`, mtp_jax.decoding.forward): phase
"first" (the trunk and head 1) then phase "rest" (heads 2..k at the decoder's slot) give the
states and caches of the one forward over every head, for every kind; sequential depths told
every token reproduce teacher forcing; a kind that ignores the phase still gives the right
heads; bad phases are one clear error. (The tokens of the decoding loops, before and after
they drove the forward in two phases: experiments/token_equality.py.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import heads
from mtp_jax.decoding.forward import Forward
from mtp_jax.model import MTPModel, init_decode_cache, unrolled

B, S = 2, 6
SLOT = np.array([5, 2], np.int32)


def _setup(make_config, make_model, kind, n_future=3):
  model, params = make_model(make_config(kind, n_future))
  params, args = unrolled(params, model.args)  # the decoding layout, as the loops use it
  toks = jnp.asarray(np.random.default_rng(0).integers(0, args.vocab_size, (B, S)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(S), (B, S))
  return MTPModel(args), params, args, toks, pos


def _close(a, b):
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-5,
                             rtol=2e-5)


@pytest.mark.parametrize("kind", ["parallel", "projection"])
def test_two_phases_equal_one_forward(make_config, make_model, kind):
  """Head 1's states, heads 2..k's at the slot and every cache entry: the same in two phases as
  in one forward of every head over every token."""
  model, params, args, toks, pos = _setup(make_config, make_model, kind)
  cache = init_decode_cache(args, B, 16)
  h_NxBxSxD, want = model.apply({"params": params}, toks, positions_BxS=pos, cache=cache,
                                decoding=True)
  fwd = Forward(model, params)
  h1_BxSxD, z_BxSxD, c = fwd.first(toks, pos, cache)
  _close(h1_BxSxD, h_NxBxSxD[0])
  h_K1xBxSxD, got = fwd.rest(toks, pos, c, z_BxSxD, heads.Drafting(slot_B=jnp.asarray(SLOT)))
  assert h_K1xBxSxD.shape == (args.n_future - 1, B, S, args.d_model)
  rows = np.arange(B)
  _close(h_K1xBxSxD[:, rows, SLOT], h_NxBxSxD[1:, rows, SLOT])
  jax.tree.map(_close, got, want)


def test_sequential_depths_told_every_token_are_teacher_forcing(make_config, make_model):
  """Phase "rest" with every next token known (after = the window shifted by one, the slot at
  its end): depth d at position s reads x_{s+d} as in training, so its states equal teacher
  forcing's wherever training reads real tokens (s + d < S)."""
  model, params, args, toks, pos = _setup(make_config, make_model, "sequential", 4)
  h_tf, _ = model.apply({"params": params}, toks)  # teacher forcing, no cache
  fwd = Forward(model, params)
  h1_BxSxD, z_BxSxD, c = fwd.first(toks, pos, init_decode_cache(args, B, 16))
  after_BxS = jnp.concatenate([toks[:, 1:], toks[:, :1]], axis=1)
  h_DxBxSxD, _ = fwd.rest(toks, pos, c, z_BxSxD, heads.Drafting(
      slot_B=jnp.full((B,), S - 1), after_BxS=after_BxS))
  _close(h1_BxSxD, h_tf[0])
  for d in range(1, args.n_future):
    _close(h_DxBxSxD[d - 1, :, :S - d], h_tf[d, :, :S - d])
  # a draft stands where a token is not known: the last position differs from training's
  assert not np.allclose(h_DxBxSxD[1, :, S - 1], h_tf[2, :, S - 1])


class Unphased(heads.HeadKind):
  """Head i is the trunk state times (i + 1), whatever the phase."""

  def __call__(self, z_BxSxD, s: heads.Shared, cache=None):
    return jnp.stack([z_BxSxD * (i + 1) for i in range(self.args.n_future)]), cache


def test_a_kind_that_ignores_phases_still_gives_the_right_heads(make_config, make_model):
  heads.register("unphased")(Unphased)
  try:
    c = make_config("parallel", 3)
    model, params = make_model(c)
    args = dataclasses.replace(model.args, head_kind="unphased")
    model, params = MTPModel(args), {k: v for k, v in params.items() if k != "heads"}
    toks = jnp.zeros((B, S), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    fwd = Forward(model, params)
    cache = init_decode_cache(args, B, 16)
    h1_BxSxD, z_BxSxD, c = fwd.first(toks, pos, cache)
    rest, _ = fwd.rest(toks, pos, c, z_BxSxD, heads.Drafting(slot_B=jnp.asarray(SLOT)))
    _close(h1_BxSxD, z_BxSxD)
    assert rest.shape[0] == 2
    _close(rest, jnp.stack([2 * z_BxSxD, 3 * z_BxSxD]))
  finally:
    heads.unregister("unphased")


def test_bad_phase_is_one_clear_error(make_config, make_model):
  model, params, args, toks, pos = _setup(make_config, make_model, "projection")
  with pytest.raises(ValueError, match=r"^phase: got 'second', allowed: "):
    model.apply({"params": params}, toks, phase="second")
  with pytest.raises(ValueError, match=r"^trunk_states_BxSxD with a decoding cache: phase "):
    model.apply({"params": params}, toks, positions_BxS=pos, phase="rest",
                cache=init_decode_cache(args, B, 16), decoding=True)


@pytest.mark.parametrize("pick", ["argmax", "sampled"])
def test_sequential_depths_drafting_at_read_slots_alone_change_nothing_kept(make_config,
                                                                             make_model, pick):
  """A cycle has the depths draft only at `decode_loop.read_slots` (the k - 2 positions up to
  the slot), not at every window position: every state and cache entry at positions up to the
  slot, all that the loop keeps, is the same as with drafts everywhere."""
  from mtp_jax.decoding import decode_loop, sampling
  model, params, args, toks, pos = _setup(make_config, make_model, "sequential", 4)
  fwd = Forward(model, params)
  h1_BxSxD, z_BxSxD, c = fwd.first(toks, pos, init_decode_cache(args, B, 16))
  slot_B = jnp.asarray(SLOT)
  after_BxS = jnp.where(jnp.arange(S) <= slot_B[:, None], jnp.roll(toks, -1, axis=1), 0)
  kw = dict(slot_B=slot_B, after_BxS=after_BxS)
  if pick == "sampled":
    kw.update(pick=sampling.picker(sampling.Settings(jnp.float32(1.0), jnp.int32(0),
                                                      jnp.float32(0.9))),
              u_DxB=jnp.asarray(np.random.default_rng(2).random((3, B)), jnp.float32))
  every, c_every = fwd.rest(toks, pos, c, z_BxSxD, heads.Drafting(**kw))
  some, c_some = fwd.rest(toks, pos, c, z_BxSxD, heads.Drafting(
      slots_BxN=decode_loop.read_slots(slot_B, args.n_future), **kw))
  for b, slot in enumerate(SLOT):
    np.testing.assert_array_equal(np.asarray(every[:, b, :slot + 1]),
                                  np.asarray(some[:, b, :slot + 1]))
    for x, y in zip(jax.tree.leaves(c_every["heads"]), jax.tree.leaves(c_some["heads"])):
      np.testing.assert_array_equal(np.asarray(x[:, b, :, :slot + 1]),
                                    np.asarray(y[:, b, :, :slot + 1]))
