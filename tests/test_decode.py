"""Greedy self-speculative decoding equals greedy decoding, token for token, on every row:
random models and briefly trained ones (where drafts really get accepted), every head kind,
ragged batches, one-token prompts, EOS inside an accepted block, max length inside a block."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from mtp_jax import decode as decode_lib
from mtp_jax import optimizer as optim_lib
from mtp_jax import sharding as shard_lib
from mtp_jax import steps as train_lib
from mtp_jax.config import base_config
from mtp_jax.model import build_model, init_params

VOCAB, PAD, EOS = 16, 14, 15
CYCLE = [3, 7, 1, 9, 4, 12, 6, EOS]  # the trained models learn this loop, EOS included
KINDS = ("parallel", "projection", "sequential")


def tiny_config(kind: str, n_future: int = 4):
  c = base_config()
  c.model.update(vocab_size=VOCAB, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=64,
                 max_len=96, n_future=n_future)
  c.model.heads.kind = kind
  c.data.seq_len = 32
  c.train.batch_size = 8
  c.train.steps = 150
  c.optim.update(lr=1e-2, warmup_steps=10)
  return c


def cyclic_batch(rng, batch: int, seq_len: int):
  starts = rng.integers(0, len(CYCLE), size=batch)
  idx = (starts[:, None] + np.arange(seq_len)) % len(CYCLE)
  return {"tokens": np.asarray(CYCLE)[idx].astype(np.int32),
          "segment_ids": np.ones((batch, seq_len), np.int32)}


@pytest.fixture(scope="module", params=KINDS)
def trained(request):
  """A model of each head kind trained once (150 steps) on the cyclic sequence."""
  c = tiny_config(request.param)
  model = build_model(c)
  tx = optim_lib.make_optimizer(c)
  state = train_lib.init_state(model, tx, c, shard_lib.make_mesh(c), jax.random.PRNGKey(0))
  step = jax.jit(train_lib.make_train_step(model, tx, c), donate_argnums=0)
  rng = np.random.default_rng(0)
  for _ in range(c.train.steps):
    state, metrics = step(state, cyclic_batch(rng, c.train.batch_size, c.data.seq_len))
  assert float(metrics["head_acc"][0]) > 0.9, "the fixture model did not learn the cycle"
  return model.args, state.params


@pytest.fixture(scope="module", params=KINDS)
def random_model(request):
  c = tiny_config(request.param)
  model = build_model(c)
  return model.args, init_params(model, jax.random.PRNGKey(1))


def both(args, params, prompts, *, k, max_new_tokens, eos_id=EOS):
  kw = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=PAD)
  return (decode_lib.greedy(params, args, prompts, **kw),
          decode_lib.decode(params, args, prompts, k=k, **kw))


def assert_same(g, s):
  np.testing.assert_array_equal(g.lengths, s.lengths)
  np.testing.assert_array_equal(g.tokens, s.tokens)


# One prompt shape (3 rows, 11 tokens padded) and one max_new_tokens for most tests, so the
# decode loop compiles once per head kind and k; row 0 is a one-token prompt.
RAGGED = [[3], [9, 4, 12, 6, EOS, 3], [5, 5, 2, 11, 0, 8, 13, 10, 2, 9, 1]]
MAX_NEW = 30


@pytest.mark.parametrize("k", [2, 4])
def test_random_model_ragged_batch(random_model, k):
  args, params = random_model
  g, s = both(args, params, RAGGED, k=k, max_new_tokens=MAX_NEW, eos_id=-1)
  assert_same(g, s)
  assert (g.lengths == MAX_NEW).all()


def test_trained_ragged_batch_accepts_drafts(trained):
  args, params = trained
  g, s = both(args, params, RAGGED, k=4, max_new_tokens=MAX_NEW, eos_id=-1)
  assert_same(g, s)
  # The cycle is learnt: drafts must pass, or this test checks nothing about acceptance.
  assert s.tokens_per_forward > 1.5, s.tokens_per_forward
  assert s.forwards < g.forwards
  # Row 0, a one-token prompt, continues the cycle.
  assert g.tokens[0].tolist() == [CYCLE[(1 + i) % len(CYCLE)] for i in range(MAX_NEW)]
  assert s.accepted_hist.sum() == s.cycles.sum()
  by_pos = s.acceptance_by_position()
  assert len(by_pos) == 3 and np.all(np.diff(by_pos) <= 1e-9) and np.all(by_pos <= 1)


def test_trained_eos_inside_accepted_block(trained):
  args, params = trained
  prompts = [[3, 7], [4, 12, 6, EOS, 3, 7, 1], [9, 4, 12, 6, EOS, 3, 7, 1, 9, 4, 12]]
  g, s = both(args, params, prompts, k=4, max_new_tokens=MAX_NEW)
  assert_same(g, s)
  for row, n in zip(g.tokens, g.lengths):
    assert row[n - 1] == EOS and (row[n:] == PAD).all()
  # Row 0 needs 6 tokens to reach EOS: at a > 1 per forward it lands inside a block.
  assert s.cycles[0] < g.lengths[0] - 1


def test_trained_max_length_inside_block(trained):
  args, params = trained
  # k = 4 gains up to 4 tokens a cycle: 1 (prefill) + 4 + 2 stops inside the second block.
  g, s = both(args, params, [[3], [1, 9]], k=4, max_new_tokens=7, eos_id=-1)
  assert_same(g, s)
  assert (s.lengths == 7).all()


def test_k1_is_greedy_with_one_token_per_forward(trained):
  args, params = trained
  g, s = both(args, params, RAGGED, k=1, max_new_tokens=MAX_NEW, eos_id=-1)
  assert_same(g, s)
  np.testing.assert_array_equal(s.cycles, s.lengths - 1)
  assert s.tokens_per_forward == 1.0


def test_k2_equals_greedy(trained):
  args, params = trained
  g, s = both(args, params, RAGGED, k=2, max_new_tokens=MAX_NEW, eos_id=-1)
  assert_same(g, s)


def test_bad_decode_arguments(random_model):
  args, params = random_model
  kw = dict(eos_id=EOS, pad_id=PAD)
  with pytest.raises(ValueError, match="--heads"):
    decode_lib.decode(params, args, [[1]], k=args.n_future + 1, max_new_tokens=4, **kw)
  with pytest.raises(ValueError, match="max_len"):
    decode_lib.decode(params, args, [[1] * 90], k=2, max_new_tokens=10, **kw)
  with pytest.raises(ValueError, match="prompt"):
    decode_lib.decode(params, args, [[]], k=2, max_new_tokens=4, **kw)
