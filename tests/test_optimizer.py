"""Optimizer and train-step details: decay mask, schedules, gradient accumulation, bf16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import optimizer as optim_lib
from mtp_jax import sharding as shard_lib
from mtp_jax import train as train_lib
from mtp_jax.model import build_model


def test_decay_mask_skips_norms_and_embeddings(make_config):
  c = make_config("parallel", 2)
  params = jax.eval_shape(lambda: train_lib.nn.unbox(
      build_model(c).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]))
  mask = optim_lib.decay_mask(params)
  flat = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_flatten_with_path(mask)[0]}
  assert not flat["['embed']['embedding']"] and not flat["['norm']"]
  assert not any(m for k, m in flat.items() if "scale" in k)
  assert all(m for k, m in flat.items() if "kernel" in k)
  assert all(jax.tree.leaves(optim_lib.decay_mask(params, decay_norms_and_embeddings=True)))


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_warms_up_then_decays(make_config, schedule):
  c = make_config("parallel", 2)
  c.train.steps, c.optim.warmup_steps, c.optim.lr = 100, 10, 1e-3
  c.optim.schedule, c.optim.min_lr_ratio = schedule, 0.1
  f = optim_lib.make_schedule(c)
  assert float(f(0)) == 0.0 and float(f(10)) == pytest.approx(1e-3)
  end = {"cosine": 1e-4, "linear": 1e-4, "constant": 1e-3}[schedule]
  assert float(f(100)) == pytest.approx(end, rel=1e-4)


def _state_and_step(c):
  model = build_model(c)
  tx = optim_lib.make_optimizer(c)
  state = train_lib.init_state(model, tx, c, shard_lib.make_mesh(c), jax.random.PRNGKey(0))
  return state, jax.jit(train_lib.make_train_step(model, tx, c))


def _batch(c, seed=0):
  rng = np.random.default_rng(seed)
  B, S = c.train.batch_size, c.data.seq_len
  return {"tokens": rng.integers(0, c.model.vocab_size, (B, S)).astype(np.int32),
          "segment_ids": np.ones((B, S), np.int32)}


def test_grad_accumulation_equals_one_big_batch(make_config):
  c = make_config("parallel", 2)
  c.train.batch_size = 4
  batch = _batch(c)
  state, step = _state_and_step(c)
  _, m1 = step(state, batch)
  c.train.grad_accum = 2
  state, step = _state_and_step(c)
  _, m2 = step(state, batch)
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-4)


def test_bf16_compute_trains(make_config):
  c = make_config("parallel", 2)
  c.model.dtype = "bfloat16"
  state, step = _state_and_step(c)
  assert jax.tree.leaves(state.params)[0].dtype == jnp.float32  # params stay f32
  batch = _batch(c)
  losses = []
  for _ in range(5):
    state, m = step(state, batch)
    losses.append(float(m["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
