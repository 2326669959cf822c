"""Training: TrainState, pure jitted train_step / eval_step, and the loop behind

    python -m mtp_jax.train --config configs/default.py --workdir DIR [--config.train.steps=N]

Rerunning the same command resumes from the latest good checkpoint in DIR/checkpoints with the
data iterator where it was, so an interrupted run ends with the same params as an uninterrupted
one (`params_sha256` in DIR/summary.json).
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags, logging
from ml_collections import config_flags

from mtp_jax import loss as loss_lib
from mtp_jax import optimizer as optim_lib
from mtp_jax import sharding as shard_lib
from mtp_jax.model import MTPModel


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def _dummy_tokens(config):
  return jnp.zeros((1, min(8, config.data.seq_len)), jnp.int32)


def _boxed_state(model: MTPModel, tx, config, rng) -> TrainState:
  """Train state whose leaves keep their logical-partitioning boxes (for shardings)."""
  params = model.init(rng, _dummy_tokens(config))["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def state_shardings(model, tx, config, mesh):
  boxed = jax.eval_shape(lambda r: _boxed_state(model, tx, config, r), jax.random.PRNGKey(0))
  return shard_lib.logical_shardings(boxed, mesh, config)


def abstract_state(model, tx, config, mesh) -> TrainState:
  """ShapeDtypeStructs (with shardings) of the unboxed train state: what restore fills in."""
  shapes = jax.eval_shape(
      lambda r: nn.unbox(_boxed_state(model, tx, config, r)), jax.random.PRNGKey(0))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, state_shardings(model, tx, config, mesh))


def init_state(model, tx, config, mesh, rng) -> TrainState:
  init = jax.jit(lambda r: nn.unbox(_boxed_state(model, tx, config, r)),
                 out_shardings=state_shardings(model, tx, config, mesh))
  return init(rng)


def make_train_step(model: MTPModel, tx, config: ml_collections.ConfigDict):
  """Pure (state, batch) -> (state, metrics). Gradient accumulation scans over micro-batches."""
  accum = config.train.grad_accum
  nan_steps = jnp.asarray(list(config.train.debug_nonfinite_steps) or [-1], jnp.int32)

  def grads_of(params, batch):
    fn = lambda p: loss_lib.model_loss(p, model, config, batch)
    (_, metrics), grads = jax.value_and_grad(fn, has_aux=True)(params)
    return grads, metrics

  def train_step(state: TrainState, batch):
    if accum == 1:
      grads, metrics = grads_of(state.params, batch)
    else:
      micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)
      def body(carry, mb):
        g, m = grads_of(state.params, mb)
        return jax.tree.map(jnp.add, carry, (g, m)), None
      zeros = jax.eval_shape(grads_of, state.params, jax.tree.map(lambda x: x[0], micro))
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
      (grads, metrics), _ = jax.lax.scan(body, zeros, micro)
      grads, metrics = jax.tree.map(lambda x: x / accum, (grads, metrics))
    # Fault injection for the reliability tests: config.train.debug_nonfinite_steps.
    poison = jnp.any(nan_steps == state.step)
    grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    consecutive, total = optim_lib.nonfinite_counts(opt_state)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads),
                   nonfinite_consecutive=consecutive, nonfinite_total=total)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def make_eval_step(model: MTPModel, config):
  def eval_step(params, batch):
    return loss_lib.model_loss(params, model, config, batch)[1]
  return eval_step


def params_sha256(params) -> str:
  """sha256 over every parameter's path and bytes, in a fixed (sorted-path) order."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
  for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
    h.update(jax.tree_util.keystr(path).encode())
    h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return h.hexdigest()


def batches_sha256(batches) -> str:
  h = hashlib.sha256()
  for b in batches:
    for k in sorted(b):
      h.update(np.ascontiguousarray(b[k]).tobytes())
  return h.hexdigest()


def head_summary(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  """Flat, JSON-friendly per-head metrics: loss, head1_loss, head2_acc, ..."""
  out = {}
  for key, value in metrics.items():
    value = np.asarray(value)
    if value.ndim == 1 and key.startswith("head_"):
      for i, v in enumerate(value):
        out[f"{prefix}head{i + 1}_{key[5:]}"] = float(v)
    elif value.ndim == 0:
      out[prefix + key] = float(value)
  return out


# The command-line run lives in run.py so this module stays a library; `python -m mtp_jax.train`
# goes through main() below.
FLAGS = flags.FLAGS


def quiet_logs():
  """Orbax logs every save step at INFO; keep the console for progress unless -v is given."""
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def parse_flags(argv):
  """absl flag parsing, with a bad flag or config override as one line instead of a traceback."""
  try:
    rest = FLAGS(argv)
    if "config" in FLAGS and FLAGS["config"].present:
      _ = FLAGS.config.model  # the config file loads lazily: fail here, not deep in the run
    return rest
  except (AttributeError, KeyError) as e:
    bad = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")
           and str(e).strip("\"' ") in a.split("=")[0].split(".")]
    where = bad[0] if bad else "--config"
    print(f"error: {where}: no such config field ({str(e).strip(chr(34))})", file=sys.stderr)
  except (flags.Error, TypeError, ValueError, OSError) as e:
    msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if "Failed loading config file" in str(e):
      msg = "--config: cannot load " + " ".join(
          line.strip() for line in str(e).splitlines()[2:] if line.strip())
    print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


def main(argv):
  from mtp_jax import run  # local: run imports this module
  del argv
  quiet_logs()
  sys.exit(run.cli_main(FLAGS))


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "ml_collections config file", lock_config=True)
  flags.DEFINE_string("workdir", None, "where checkpoints, metrics and summary.json go")
  app.run(main, flags_parser=parse_flags)
