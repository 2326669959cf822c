"""optim.trainable = "heads" skips the trunk's backward pass: the frozen params sit behind
lax.stop_gradient (optimizer.stop_frozen_gradients) and head 1's loss is computed forward only
(loss.mtp_sums frozen_heads). The gradients of the trained heads are those of the full backward
pass, the frozen ones come out zero, and the compiled gradient is cheaper and smaller."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from mtp_jax.config import validation
from mtp_jax import optimizer as optim_lib
from mtp_jax import steps


# Heavy tier for projection (~13 s): parallel (head 1 in a stacked leaf with the new heads) and
# sequential (the chain) are the hard cases; projection heads are plain leaves of their own.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parallel", pytest.param("projection",
                                                           marks=pytest.mark.heavy),
                                  "sequential"])
def test_heads_only_gradients_equal_the_full_backward(kind, make_config, make_model):
  c = make_config(kind, 3)
  c.model.remat_policy, c.model.scan_layers = "full", False  # unrolled: FLOPs count every block
  c.optim.trainable = "heads"
  c = validation.resolve(c)
  full = c.copy_and_resolve_references()
  full.optim.trainable = "all"
  model, params = make_model(c)
  rng = np.random.default_rng(0)
  batch = {"tokens": rng.integers(0, 61, (2, 16)).astype(np.int32),
           "segment_ids": np.repeat([[1] * 10 + [2] * 6], 2, axis=0).astype(np.int32)}
  out = {}
  for name, cfg in (("heads", c), ("all", full)):
    compiled = jax.jit(steps.make_grad_fn(model, cfg)).lower(params, batch).compile()
    grads, metrics = compiled(params, batch)
    out[name] = (flatten_dict(grads), metrics, compiled.cost_analysis()["flops"],
                 compiled.memory_analysis().temp_size_in_bytes)
  trained = optim_lib.trained_slots(c)
  (g_heads, m_heads, flops_heads, temp_heads), (g_all, m_all, flops_all, temp_all) = (
      out["heads"], out["all"])
  n_trained = 0
  for path, g in g_heads.items():
    g, slots = np.asarray(g), trained.get(path[:2])
    if slots is None:  # frozen: no backward pass reached it
      assert not np.any(g), path
      continue
    np.testing.assert_allclose(g[slots], np.asarray(g_all[path])[slots], rtol=0, atol=1e-6,
                               err_msg=str(path))
    assert np.any(g[slots]), path
    frozen_slots = [i for i in range(g.shape[0]) if i not in slots]  # head 1's parallel block
    assert not np.any(g[frozen_slots]), path
    n_trained += 1
  assert n_trained > 0
  for key in ("head_loss", "head_acc", "head_agree"):  # the metrics: every head, head 1 too
    np.testing.assert_allclose(m_heads[key], m_all[key], rtol=1e-6, err_msg=key)
  assert flops_heads < 0.85 * flops_all, (flops_heads, flops_all)
  assert temp_heads < temp_all, (temp_heads, temp_all)
