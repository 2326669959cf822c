"""The optax chain from `config.optim`: global-norm clipping, AdamW with a weight-decay mask,
warmup then cosine / linear / constant, and `optax.apply_if_finite` so a step whose gradients
are not finite is skipped (params and moments untouched) and counted.

`optim.trainable = "heads"` (Medusa-style heads on a frozen next-token model; Gloeckle et al.
2024's fine-tuning experiments train the whole model instead, "all") trains heads 2..n only:
every other leaf goes to `optax.set_to_zero` through `optax.multi_transform`, so it has no
optimizer state and its update is exactly zero (steps.apply_updates then leaves the params
bit-identical, signed zeros included). A stack that holds head 1 too
(parallel heads: blocks[0] is head 1's block) is trained as a whole leaf with the frozen slots'
gradients and updates zeroed (`freeze_slots`): one block's moments are allocated, never used.

The gradient itself skips the frozen model: `stop_frozen_gradients` puts a `lax.stop_gradient`
on every frozen leaf and frozen slot before the forward pass (steps.make_grad_fn), so the trunk
carries no tangent and its backward pass (and its remat recomputation) is never built; the
backward covers heads 2..n (and the unembedding's input gradient) only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from mtp_jax import heads as heads_lib

# apply_if_finite applies the update anyway after this many consecutive bad steps; the train
# loop stops itself after `optim.max_consecutive_nonfinite`, so never let optax give in first.
_NEVER = 2**31 - 1


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  o, steps = config.optim, config.train.steps
  warmup = min(o.warmup_steps, steps)
  decay_steps = max(steps - warmup, 1)
  end = o.lr * o.min_lr_ratio
  if o.schedule == "cosine":
    after = optax.cosine_decay_schedule(o.lr, decay_steps, alpha=o.min_lr_ratio)
  elif o.schedule == "linear":
    after = optax.linear_schedule(o.lr, end, decay_steps)
  else:
    after = optax.constant_schedule(o.lr)
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, o.lr, warmup), after], [warmup])


def _names(path) -> tuple[str, ...]:
  """A tree path's keys as plain names (("heads", "parallel", "kernel")), for lookups; strings
  for messages come from jax.tree_util.keystr."""
  return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def decay_mask(params, decay_norms_and_embeddings: bool = False):
  """True where weight decay applies: every matrix, and norms and embeddings only if asked."""
  def leaf_mask(path, _):
    is_matrix = _names(path)[-1] == "kernel"
    return is_matrix or decay_norms_and_embeddings
  return jax.tree_util.tree_map_with_path(leaf_mask, params)


def trained_slots(config: ml_collections.ConfigDict) -> dict[tuple[str, str], list[int]]:
  """optim.trainable = "heads": {("heads", stack): slots on its stacked axis holding heads
  2..n}, from the head kind's own `head_params` (nothing here names a kind)."""
  kind = heads_lib.KINDS[config.model.heads.kind]
  out = {}
  for j in range(2, config.model.n_future + 1):
    for path, index in kind.head_params(j):
      out.setdefault(tuple(path), []).append(index)
  return out


def trainable_labels(params, trained: dict) -> object:
  """"train" for the leaves of a trained stack, "frozen" for every other leaf."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "train" if _names(path)[:2] in trained else "frozen", params)


def _slot_mask(slots, x):
  keep = jnp.zeros(x.shape[0], bool).at[jnp.asarray(slots)].set(True)
  return keep.reshape((-1,) + (1,) * (x.ndim - 1))


def stop_frozen_gradients(params, trained: dict):
  """params with `lax.stop_gradient` on every leaf optim.trainable = "heads" freezes, and on the
  frozen slots of a trained stack (head 1's block in a parallel stack): the same values, but
  jax.grad builds no backward pass through the trunk (nor head 1's slot), and their gradients
  come out as zeros, which the optimizer ignores anyway."""

  def cut(path, x):
    slots = trained.get(_names(path)[:2])
    if slots is None:
      return jax.lax.stop_gradient(x)
    if len(slots) == x.shape[0]:
      return x
    return jnp.where(_slot_mask(slots, x), x, jax.lax.stop_gradient(x))

  return jax.tree_util.tree_map_with_path(cut, params)


def freeze_slots(trained: dict) -> optax.GradientTransformation:
  """Zeroes the slots of a trained stack that are not in `trained` (head 1's block in a
  parallel stack): before the clip and Adam its gradient, so it neither counts in the global
  norm nor moves the moments; after them its update (weight decay included)."""

  def zero(path, u):
    slots = trained.get(_names(path)[:2])
    if slots is None or u is None or len(slots) == u.shape[0]:
      return u
    return jnp.where(_slot_mask(slots, u), u, jnp.zeros_like(u))

  def update(updates, state, params=None):
    del params
    return jax.tree_util.tree_map_with_path(zero, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  o = config.optim
  mask = lambda p: decay_mask(p, o.decay_norms_and_embeddings)
  inner = optax.chain(
      optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
      optax.adamw(make_schedule(config), b1=o.b1, b2=o.b2, eps=o.eps,
                  weight_decay=o.weight_decay, mask=mask),
  )
  if o.trainable == "heads":
    trained = trained_slots(config)
    inner = optax.chain(
        freeze_slots(trained),
        optax.multi_transform({"train": inner, "frozen": optax.set_to_zero()},
                              lambda p: trainable_labels(p, trained)),
        freeze_slots(trained))
  return optax.apply_if_finite(inner, max_consecutive_errors=_NEVER)


def nonfinite_counts(opt_state) -> tuple[jax.Array, jax.Array]:
  """(consecutive, total) skipped steps, from the apply_if_finite state."""
  return opt_state.notfinite_count, opt_state.total_notfinite
