"""The head-kind registry: a new kind is one class (here a throwaway one, defined and registered in
the test) that validates, trains and decodes with no other change; the built-in kinds' parameter
layouts (`stacks`, `head_params`, `slice_params`) match the models they build."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtp_jax.config import validation
from mtp_jax.decoding import decode as decode_lib
from mtp_jax import flops as flops_lib
from mtp_jax import heads
from mtp_jax.layers import rms_norm
from mtp_jax.loss import model_loss
from mtp_jax.model import build_model, init_params

CYCLE = [3, 7, 1, 9, 4, 12, 6, 10]


class BiasHeads(heads.HeadKind):
  """Head i is the trunk state plus a learned bias b_i, then the shared final norm."""
  stacks = {"bias": 1}  # params["heads"]["bias"][i] is head i + 1

  @classmethod
  def flops_per_token(cls, m, block):
    return 0, 0  # a bias add: no matmul, no attention

  @nn.compact
  def __call__(self, z_BxSxD, s: heads.Shared, cache=None):
    a = self.args
    b_NxD = self.param("bias", nn.initializers.zeros, (a.n_future, a.d_model), jnp.float32)
    h_NxBxSxD = z_BxSxD[None] + b_NxD[:, None, None].astype(z_BxSxD.dtype)
    return rms_norm(h_NxBxSxD, s.norm_D, a.norm_eps), cache


@pytest.fixture
def bias_kind():
  before = tuple(heads.KINDS)
  heads.register("bias")(BiasHeads)
  yield BiasHeads
  heads.unregister("bias")
  assert tuple(heads.KINDS) == before


def test_registering_a_name_twice_is_an_error(bias_kind):
  with pytest.raises(ValueError, match="'bias' is already registered"):
    heads.register("bias")(bias_kind)


def test_unregistered_kind_is_a_config_error(make_config):
  with pytest.raises(ValueError, match=r"^config\.model\.heads\.kind: got 'bias'"):
    validation.validate(make_config("bias", 3))


@pytest.mark.slow
def test_new_kind_in_one_class_trains_and_decodes(bias_kind, make_config):
  c = make_config("bias", 3)
  model = build_model(c)  # validates: the registry knows the kind
  assert model.args.n_trunk == c.model.n_layers  # the default: heads take no trunk blocks
  params = init_params(model, jax.random.PRNGKey(0))
  assert params["heads"]["bias"].shape == (3, c.model.d_model)

  tx = optax.adam(1e-2)
  starts = np.random.default_rng(0).integers(0, len(CYCLE), size=8)
  idx = (starts[:, None] + np.arange(c.data.seq_len)) % len(CYCLE)
  batch = {"tokens": np.asarray(CYCLE, np.int32)[idx],
           "segment_ids": np.ones((8, c.data.seq_len), np.int32)}

  @jax.jit
  def step(params, opt_state):
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: model_loss(p, model, c, batch), has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics["head_loss"]

  opt_state = tx.init(params)
  losses, bias_before = [], params["heads"]["bias"]
  for _ in range(40):
    params, opt_state, loss, head_loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0], losses
  assert head_loss.shape == (3,)
  assert float(jnp.abs(params["heads"]["bias"] - bias_before).max()) > 0  # the heads train

  # FLOPs: the kind counts its own (none), flops.py the trunk of n_layers blocks and the rest.
  f, m = flops_lib.flops_per_token(c), c.model
  block = flops_lib._block(m.d_model, m.n_heads, m.n_kv_heads, m.d_ff)
  assert f["heads"] == 0 and f["trunk"] == 3 * m.n_layers * block
  assert f["unembedding"] == 3 * 3 * 2 * m.d_model * m.vocab_size

  kw = dict(max_new_tokens=12, eos_id=-1, pad_id=0)
  prompts = [[3, 7], [9], [6, 10, 3, 7, 1]]
  g = decode_lib.plain(params, model.args, prompts, **kw)
  for k in (2, 3):
    s = decode_lib.decode(params, model.args, prompts, k=k, **kw)
    np.testing.assert_array_equal(s.tokens, g.tokens)
    np.testing.assert_array_equal(s.lengths, g.lengths)


class Uncounted(heads.HeadKind):
  """A kind that does not count its FLOPs (no flops_per_token)."""


def test_kind_without_flops_hook_is_one_clear_error(make_config):
  heads.register("uncounted")(Uncounted)
  try:
    with pytest.raises(ValueError, match=r"^head kind 'uncounted' does not count its FLOPs "):
      flops_lib.flops_per_token(make_config("uncounted", 2))
  finally:
    heads.unregister("uncounted")


def _abstract(config):
  model = build_model(config)
  return jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))


def _shapes(tree):
  return jax.tree.map(lambda x: tuple(x.shape), tree)


@pytest.mark.parametrize("kind", tuple(heads.KINDS))
def test_layout_every_stacked_index_is_one_head(make_config, kind):
  """head_params(j) for j = 1..n names every index of every stack exactly once."""
  n = 3
  params = _abstract(make_config(kind, n))
  cls = heads.KINDS[kind]
  seen = []
  for j in range(1, n + 1):
    for path, index in cls.head_params(j):
      node = params
      for part in path:
        node = node[part]
      sizes = {x.shape[0] for x in jax.tree.leaves(node)}  # every leaf stacked alike
      assert len(sizes) == 1 and 0 <= index < sizes.pop(), (j, path, index)
      seen.append((path, index))
  stacked = [(("heads", name), i) for name in cls.stacks
             for i in range(jax.tree.leaves(params["heads"][name])[0].shape[0])]
  assert sorted(seen) == sorted(stacked)
  if kind != "parallel":
    assert cls.head_params(1) == []  # head 1 is the trunk itself


@pytest.mark.parametrize("kind", tuple(heads.KINDS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_slice_params_is_the_heads_of_a_k_head_model(make_config, kind, k):
  params = _abstract(make_config(kind, 3))
  sliced = jax.eval_shape(lambda p: heads.slice_params(p, heads.KINDS[kind], k), params)
  want = _abstract(make_config(kind, k))
  assert _shapes(sliced.get("heads")) == _shapes(want.get("heads"))
  assert _shapes(sliced["trunk"]) == _shapes(params["trunk"])  # the trunk is untouched
