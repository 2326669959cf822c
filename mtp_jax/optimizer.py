"""The optax chain from `config.optim`: global-norm clipping, AdamW with a weight-decay mask,
warmup then cosine / linear / constant, and `optax.apply_if_finite` so a step whose gradients
are not finite is skipped (params and moments untouched) and counted."""

from __future__ import annotations

import jax
import ml_collections
import optax

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


def decay_mask(params, decay_norms_and_embeddings: bool = False):
  """True where weight decay applies: every matrix, and norms and embeddings only if asked."""
  def leaf_mask(path, _):
    names = [getattr(k, "key", str(k)) for k in path]
    is_matrix = names[-1] == "kernel"
    return is_matrix or decay_norms_and_embeddings
  return jax.tree_util.tree_map_with_path(leaf_mask, params)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  o = config.optim
  mask = lambda p: decay_mask(p, o.decay_norms_and_embeddings)
  inner = optax.chain(
      optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
      optax.adamw(make_schedule(config), b1=o.b1, b2=o.b2, eps=o.eps,
                  weight_decay=o.weight_decay, mask=mask),
  )
  return optax.apply_if_finite(inner, max_consecutive_errors=_NEVER)


def nonfinite_counts(opt_state) -> tuple[jax.Array, jax.Array]:
  """(consecutive, total) skipped steps, from the apply_if_finite state."""
  return opt_state.notfinite_count, opt_state.total_notfinite
