"""Greedy self-speculative decoding equals greedy decoding, token for token, on every row:
random models and briefly trained ones (where drafts really get accepted), every head kind,
ragged batches, one-token prompts, EOS inside an accepted block, max length inside a block. The
acceptance rule of one cycle (`accept_greedy`) against hand-worked cases."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import force_costs

from mtp_jax.decoding import decode as decode_lib
from mtp_jax.model import build_model, init_params

from experiments import token_equality
from experiments.token_equality import CYCLE, EOS, KINDS, PAD
from experiments.token_equality import config as tiny_config


# Heavy tier: the projection kind's trained fixture and its tests (~25 s: 150 train steps, then
# the decodes); its speculative = greedy on random params (random_model) stays in make test, and
# the trained cycle's acceptance stays for parallel and sequential heads.
@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.heavy)
                                        if k == "projection" else k for k in KINDS])
def trained(request):
  """A model of each head kind trained once (150 steps) on the cyclic sequence."""
  args, params, head1_acc = token_equality.train(request.param)
  assert head1_acc > 0.9, "the fixture model did not learn the cycle"
  return args, params


@pytest.fixture(scope="module", params=KINDS)
def random_model(request):
  c = tiny_config(request.param)
  model = build_model(c)
  return model.args, init_params(model, jax.random.PRNGKey(1))


def both(args, params, prompts, *, k, max_new_tokens, eos_id=EOS):
  kw = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=PAD)
  return (decode_lib.plain(params, args, prompts, **kw),
          decode_lib.decode(params, args, prompts, k=k, **kw))


def assert_same(g, s):
  np.testing.assert_array_equal(g.lengths, s.lengths)
  np.testing.assert_array_equal(g.tokens, s.tokens)


# One prompt shape (3 rows, 11 tokens padded) and one max_new_tokens for most tests, so the
# decode loop compiles once per head kind and k; row 0 is a one-token prompt.
RAGGED = [[3], [9, 4, 12, 6, EOS, 3], [5, 5, 2, 11, 0, 8, 13, 10, 2, 9, 1]]
MAX_NEW = 30


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_random_model_ragged_batch(random_model, k):
  args, params = random_model
  g, s = both(args, params, RAGGED, k=k, max_new_tokens=MAX_NEW, eos_id=-1)
  assert_same(g, s)
  assert (g.lengths == MAX_NEW).all()


@pytest.mark.slow
def test_trained_ragged_batch_accepts_drafts(trained):
  args, params = trained
  g, s = both(args, params, RAGGED, k=4, max_new_tokens=MAX_NEW, eos_id=-1)
  assert_same(g, s)
  # The cycle is learnt: drafts must pass, or this test checks nothing about acceptance.
  assert s.tokens_per_forward > 1.5, s.tokens_per_forward
  assert s.forwards < g.forwards
  # Row 0, a one-token prompt, continues the cycle.
  assert g.tokens[0].tolist() == [CYCLE[(1 + i) % len(CYCLE)] for i in range(MAX_NEW)]


@pytest.mark.slow
def test_trained_eos_inside_accepted_block(trained):
  args, params = trained
  prompts = [[3, 7], [4, 12, 6, EOS, 3, 7, 1], [9, 4, 12, 6, EOS, 3, 7, 1, 9, 4, 12]]
  g, s = both(args, params, prompts, k=4, max_new_tokens=MAX_NEW)
  assert_same(g, s)
  for row, n in zip(g.tokens, g.lengths):
    assert row[n - 1] == EOS and (row[n:] == PAD).all()
  # Row 0 needs 6 tokens to reach EOS: at a > 1 per forward it lands inside a block.
  assert s.cycles[0] < g.lengths[0] - 1


@pytest.mark.slow
def test_trained_max_length_inside_block(trained):
  args, params = trained
  # k = 4 gains up to 4 tokens a cycle: 1 (prefill) + 4 + 2 stops inside the second block.
  g, s = both(args, params, [[3], [1, 9]], k=4, max_new_tokens=7, eos_id=-1)
  assert_same(g, s)
  assert (s.lengths == 7).all()
  # It did stop there: two cycles a row, the first accepting all 3 drafts (4 tokens), the
  # second accepting all 3 again but cut to the 2 tokens the budget left.
  assert s.cycles.tolist() == [2, 2] and s.forwards == 3, (s.cycles, s.forwards)
  assert s.accepted_hist.tolist() == [0, 0, 0, 4], s.accepted_hist


@pytest.mark.slow  # its trained fixture: 150 steps per kind
def test_k1_is_greedy_with_one_token_per_forward(trained):
  args, params = trained
  g, s = both(args, params, RAGGED, k=1, max_new_tokens=MAX_NEW, eos_id=-1)
  assert_same(g, s)
  np.testing.assert_array_equal(s.cycles, s.lengths - 1)
  assert s.tokens_per_forward == 1.0


@pytest.mark.slow
def test_k2_equals_greedy(trained):
  args, params = trained
  g, s = both(args, params, RAGGED, k=2, max_new_tokens=MAX_NEW, eos_id=-1)
  assert_same(g, s)


@pytest.mark.slow
def test_bad_decode_arguments(random_model):
  args, params = random_model
  kw = dict(eos_id=EOS, pad_id=PAD)
  with pytest.raises(ValueError, match="^k: "):
    decode_lib.decode(params, args, [[1]], k=args.n_future + 1, max_new_tokens=4, **kw)
  with pytest.raises(ValueError, match="max_len"):
    decode_lib.decode(params, args, [[1] * 90], k=2, max_new_tokens=10, **kw)
  with pytest.raises(ValueError, match="prompt"):
    decode_lib.decode(params, args, [[]], k=2, max_new_tokens=4, **kw)


# accept_greedy, one cycle's rule, by hand. k = 4: the window is [last, d1, d2, d3], head 1's
# argmax g0..g3; draft d(j+1) is accepted while it equals g_j and all before it were accepted.
# (name, drafts d1..d3, g0..g3, budget, (accepted m, tokens gained n, new last, EOS among them))
LAST = 1
ACCEPT_CASES = [
    ("all_accepted", [5, 6, 7], [5, 6, 7, 8], 10, (3, 4, 8, False)),
    ("first_rejected", [9, 6, 7], [5, 6, 7, 8], 10, (0, 1, 5, False)),
    # d3 equals g2, but after a rejection it does not count.
    ("second_rejected", [5, 9, 7], [5, 6, 7, 8], 10, (1, 2, 6, False)),
    ("third_rejected", [5, 6, 9], [5, 6, 7, 8], 10, (2, 3, 7, False)),
    ("eos_inside_accepted_run", [5, EOS, 7], [5, EOS, 7, 8], 10, (3, 2, EOS, True)),
    ("eos_first", [9, 9, 9], [EOS, 6, 7, 8], 10, (0, 1, EOS, True)),
    # An EOS past the rejected draft is never gained.
    ("eos_after_rejection", [5, 9, EOS], [5, 6, EOS, 8], 10, (1, 2, 6, False)),
    ("budget_cut", [5, 6, 7], [5, 6, 7, 8], 2, (3, 2, 6, False)),
    ("budget_cuts_before_eos", [5, 6, EOS], [5, 6, EOS, 8], 2, (3, 2, 6, False)),
    ("finished_row", [5, 6, 7], [5, 6, 7, 8], 0, (3, 0, LAST, False)),
]


def test_accept_greedy_hand_worked_cases():
  names, drafts, greedy, budget, want = zip(*ACCEPT_CASES)
  B = len(names)
  got = decode_lib.accept_greedy(np.asarray(drafts, np.int32), np.asarray(greedy, np.int32),
                                 np.full(B, LAST, np.int32), EOS, np.asarray(budget, np.int32))
  got = [tuple(x) for x in zip(*(np.asarray(a).tolist() for a in got))]
  for name, w, g in zip(names, want, got):
    assert g == w, (name, g, w)


def test_acceptance_by_position_by_hand():
  # 10 row-cycles: 1 accepted no draft, 2 one, 3 two, 4 all three. Draft 1 passed in 9 of 10,
  # draft 2 in 7, draft 3 in 4.
  r = decode_lib.DecodeResult(tokens=np.zeros((1, 1)), lengths=np.asarray([21]),
                              cycles=np.asarray([10]), accepted_hist=np.asarray([1, 2, 3, 4]),
                              forwards=11)
  np.testing.assert_allclose(r.acceptance_by_position(), [0.9, 0.7, 0.4])
  assert r.tokens_per_forward == 2.0  # 20 tokens after prefill in 10 cycles


def test_decoder_compiles_once_and_runs_any_prompts_of_its_shape(random_model):
  args, params = random_model
  decoder = decode_lib.Decoder(params, args, k=2, batch=3, prompt_len=11, max_new_tokens=MAX_NEW)
  ids = dict(eos_id=-1, pad_id=PAD)
  assert decoder.compile_seconds >= 0
  first = decoder(RAGGED, **ids)
  assert_same(decode_lib.decode(params, args, RAGGED, k=2, max_new_tokens=MAX_NEW, **ids), first)
  other = [[2, 2], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
  assert_same(decode_lib.decode(params, args, other, k=2, max_new_tokens=MAX_NEW, **ids),
              decoder(other, **ids))
  with pytest.raises(ValueError, match="^prompt: this Decoder takes 3 prompts"):
    decoder(RAGGED[:2], **ids)
  with pytest.raises(ValueError, match="^prompt: this Decoder takes 3 prompts"):
    decoder([[1] * 12, [1], [1]], **ids)


# heads="auto" (mtp_jax.decoding.costmodel): a forced cost model decides; the probe's acceptance is
# real.
@pytest.mark.slow  # its trained fixture
@pytest.mark.parametrize("tk_over_t1, want", [(10.0, 1), (1.0, 4)])
def test_auto_heads_follow_the_cost_model(trained, monkeypatch, tk_over_t1, want):
  """A k-token forward 10x a one-token one: speculation loses, auto runs plain decoding; as
  cheap as one token: the most heads win (the trained model accepts every draft)."""
  args, params = trained
  force_costs(monkeypatch, lambda t: 1.0 if t.k == 1 else tk_over_t1 * (1 + 0.01 * t.k))
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD)
  g = decode_lib.plain(params, args, RAGGED, **kw)
  r = decode_lib.decode(params, args, RAGGED, k="auto", **kw)
  assert_same(g, r)
  assert r.heads == want and r.auto["heads"] == want, r.auto
  table = {row["heads"]: row for row in r.auto["table"]}
  assert table[4]["a_mean"] > 2.5  # the probe saw drafts accepted (row 2 is off the cycle)
  assert 1.0 <= table[4]["a_predicted"] <= table[4]["a_mean"]  # the slowest row, pessimistic
  assert r.auto["S_predicted"] == (1.0 if want == 1 else table[4]["S_predicted"])


@pytest.mark.slow  # its trained fixture
def test_auto_checks_its_pick_on_its_own_loop(trained, monkeypatch):
  """The forwards say heads 1..3 cost what one token does, but their own loop costs 10x: auto
  probes its pick (heads 1..3) before betting, finds it would lose, chooses again (heads 1..2,
  whose loop is as cheap as its forward) and checks that one too, twice (a bet is read from two
  probes: session.BET_PROBES), then reads its S once more from a probe it does not choose on
  (session.HELD_OUT); the output is greedy's."""
  args, params = trained
  probed = []
  wins = lambda t: t.k < 4  # forwards: the chain of 4 (the probe) 10x, the others 1
  force_costs(monkeypatch, lambda t: 1.0 if wins(t) else 10.0,
              lambda t: probed.append(t.name) or (1.0 if t.k in (1, 2) else 10.0))
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD)
  r = decode_lib.decode(params, args, RAGGED, k="auto", **kw)
  assert_same(decode_lib.plain(params, args, RAGGED, **kw), r)
  assert probed == ["1,1,1", "", "1,1", "", "1", "", "1", "", "1", ""] and r.heads == 2, (
      probed, r.auto)
  table = {row["heads"]: row for row in r.auto["table"]}
  assert [h for h, row in table.items() if row["own_loop"]] == [2, 3, 4]
  assert [row["probes"] for row in table.values()] == [0, 2, 1, 1]
  assert table[3]["S_predicted"] < 1 < table[2]["S_predicted"] == r.auto["S_chosen"]
  assert r.auto["S_predicted"] == pytest.approx(r.auto["S_chosen"])  # the same costs forced


# Heavy tier (~22 s: four decodes compiled twice): make test checks the slot forward against the
# every-token one directly (tests/test_two_phase.py), states and caches.
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("trained", ["parallel"], indirect=True)  # the other kinds not built
def test_parallel_slot_cycle_equals_every_token_cycle(trained):
  """Parallel heads decode with heads 2..k's full block at the read slot alone (their keys and
  values written at every window token): the same drafts as every head block over every window
  token (experiments/parallel_cycle.EveryTokenHeads, the same params), so the same acceptance
  histogram, forwards and tokens: greedy chain and tree, and sampled chain and tree at a fixed
  seed (whose tokens depend on the drafts' distributions)."""
  from experiments.parallel_cycle import every_token
  from mtp_jax.model import unrolled
  args, params = trained
  assert args.head_kind == "parallel"  # the slot cycle is the parallel heads'
  assert unrolled(params, args)[1].parallel_stack == "split"
  kw = dict(k=4, max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD)
  runs = [dict(), dict(tree="2,2,1"), dict(temperature=1.0, seed=3),
          dict(temperature=1.0, seed=3, tree="2,2,1")]
  new = [decode_lib.decode(params, args, RAGGED, **kw, **r) for r in runs]
  with every_token(args) as ref_args:
    from mtp_jax import heads
    assert not heads.KINDS[ref_args.head_kind].read_at_slot  # every head over every token
    old = [decode_lib.decode(params, ref_args, RAGGED, **kw, **r) for r in runs]
    # the k-token forward the cost model times (costmodel.forward_program) is the slot one:
    # fewer FLOPs (XLA's exact count) than every head block over every window token
    from experiments.parallel_cycle import forward_flops
    slot, every = (forward_flops(params, a, 4, 2, 8) for a in (args, ref_args))
    assert slot < 0.9 * every, (slot, every)
  for r, n, o in zip(runs, new, old):
    assert_same(o, n)
    np.testing.assert_array_equal(o.rows_hist, n.rows_hist, err_msg=str(r))
    assert o.forwards == n.forwards
    assert n.accepted_hist[1:].sum() > 0, f"{r}: no draft accepted, nothing compared"
