"""The cost model behind heads="auto" / tree="auto" (mtp_jax.decoding.costmodel), by hand: the
depth a candidate would reach on a probe's cycles, the slowest row's predicted a, and the choice."""

from __future__ import annotations

import numpy as np
import pytest

from mtp_jax.decoding import costmodel
from mtp_jax.decoding.tree import Tree, parse


def test_reached_depth_by_hand():
  # Probe 2,1: 0 root; 1 (head 2's first), 2 (its second); 3 under 1, 4 under 2.
  probe = parse("2,1")
  assert costmodel.reached_depth(probe, costmodel.chain(1)).tolist() == [0, 0, 0, 0, 0]
  assert costmodel.reached_depth(probe, costmodel.chain(2)).tolist() == [0, 1, 0, 1, 0]
  assert costmodel.reached_depth(probe, costmodel.chain(3)).tolist() == [0, 1, 0, 2, 0]
  assert costmodel.reached_depth(probe, parse("2")).tolist() == [0, 1, 1, 1, 1]
  assert costmodel.reached_depth(probe, probe).tolist() == [0, 1, 1, 2, 2]


def test_predict_a_pools_and_takes_the_slowest_row():
  probe = parse("2,1")
  both_rows = np.asarray([[0, 0, 0, 5, 5], [0, 0, 0, 5, 5]])
  assert costmodel.predict_a(both_rows, probe, costmodel.chain(3)) == pytest.approx(2.0)
  assert costmodel.predict_a(both_rows, probe, probe) == pytest.approx(3.0)
  # Row 1 never accepts: the batch goes at its pace, pulled toward the pool by PRIOR cycles.
  uneven = np.asarray([[0, 0, 0, 10, 0], [10, 0, 0, 0, 0]])
  prior = costmodel.PRIOR
  row1 = 1 + (prior * 0.5 * 2) / (10 + prior)
  assert costmodel.predict_a(uneven, probe, costmodel.chain(3)) == pytest.approx(row1)


def test_expected_max_by_hand():
  assert costmodel.expected_max([3.0], [2.0]) == pytest.approx(3.0, abs=1e-6)  # one: its mean
  # two i.i.d. normals: mean + sd / sqrt(pi); 32 standard normals: 2.0697 (tables)
  assert costmodel.expected_max([1.0, 1.0], [2.0, 2.0]) == pytest.approx(
      1 + 2 / np.sqrt(np.pi), abs=1e-6)
  assert costmodel.expected_max(np.zeros(32), np.ones(32)) == pytest.approx(2.0697, abs=1e-3)


def test_predict_a_expected_slowest_row_by_hand():
  """a = N / E[max over rows of the cycles a row needs]: each row's cycles ~ Normal(N / a,
  N s^2 / a^3 + (N / a^2)^2 s^2 / (n + PRIOR)); a row that always reaches the same depth has no
  spread, and one row's expected cycles are N / its mean (no pessimism beyond the slowest row)."""
  probe, prior = costmodel.chain(3), costmodel.PRIOR
  sure = np.asarray([[0, 0, 12]] * 8)  # every cycle: both drafts
  assert costmodel.predict_a(sure, probe, probe, max_new_tokens=30) == pytest.approx(3.0)
  half = np.asarray([[6, 0, 6]])  # depth 0 or 2, half each: mean a 2, variance 1
  assert costmodel.predict_a(half, probe, probe) == pytest.approx(2.0)
  assert costmodel.predict_a(half, probe, probe, max_new_tokens=60) == pytest.approx(2.0)
  n, a = 60.0, 2.0
  sd = np.sqrt(n / a ** 3 + (n / a ** 2) ** 2 / (12 + prior))
  two = costmodel.predict_a(np.concatenate([half, half]), probe, probe, max_new_tokens=60)
  assert two == pytest.approx(n / (n / a + sd / np.sqrt(np.pi)), rel=1e-5)
  never = np.asarray([[12, 0, 0]] * 4)
  assert costmodel.predict_a(never, probe, probe, max_new_tokens=60) == 1.0  # plain's


def test_batch_32_with_a_small_spread_is_not_floored_at_1():
  """32 rows of about the same acceptance (chain:4, mean a about 1.7 per row, as measured at
  batch 32): the expected slowest row is below the mean but well above plain's 1 (the rule of
  z standard errors below the slowest row floored every candidate at 1 here)."""
  probe, rng = costmodel.chain(4), np.random.default_rng(0)
  hist = np.stack([np.asarray([7, 3, 1, 1]) + rng.integers(0, 2, 4) for _ in range(32)])
  mean = costmodel.predict_a(hist, probe, probe)
  assert 1.6 < mean < 1.8
  a = costmodel.predict_a(hist, probe, probe, max_new_tokens=128)
  assert 1.25 < a < mean
  for cand in costmodel.candidates(4, trees=False)[1:]:
    assert costmodel.predict_a(hist, probe, cand, max_new_tokens=128) > 1.1


def test_the_slowest_row_keeps_plain_where_one_row_would_gamble():
  """A chain of 2 whose mean a (1.5) beats its cost (1.3) by 15%, on rows probed for 4 cycles
  that split half and half: one row bets (its expected a is its mean, MIN_GAIN the margin);
  8 such rows, whose slowest sets the pace, stay with plain decoding."""
  probe, cands = costmodel.chain(2), costmodel.candidates(2, trees=False)
  seconds = lambda c: (1.0, 1.0 if c.k == 1 else 1.3)
  one = costmodel.choose(np.asarray([[2, 2]]), probe, cands, seconds, max_new_tokens=64)
  assert one["tree"] == probe and one["a_predicted"] == pytest.approx(1.5)
  kept = costmodel.choose(np.asarray([[2, 2]] * 8), probe, cands, seconds, max_new_tokens=64)
  assert kept["tree"] == costmodel.chain(1) and kept["S_predicted"] == 1.0
  row = kept["table"][1]
  assert row["a_mean"] == pytest.approx(1.5) and row["a_predicted"] < 1.3 * costmodel.MIN_GAIN


def test_choose_plain_unless_a_candidate_gains_enough():
  probe = costmodel.chain(4)
  hist = np.asarray([[0, 0, 0, 8]])  # every cycle accepted all 3 drafts: a(k) = k
  cands = costmodel.candidates(4, trees=False)
  cheap = costmodel.choose(hist, probe, cands, lambda c: (1.0, 1.0))
  assert cheap["tree"] == costmodel.chain(4) and cheap["S_predicted"] == pytest.approx(4.0)
  costly = costmodel.choose(hist, probe, cands, lambda c: (1.0, 1.0 if c.k == 1 else 5.0))
  assert costly["tree"] == costmodel.chain(1) and costly["S_predicted"] == 1.0
  # k = 2 at cost 1.5: S 1.33; k = 3 at 2.5: 1.2; k = 4 at 4.5: 0.89. The best is k = 2.
  mid = costmodel.choose(hist, probe, cands, lambda c: (1.0, [1.0, 1.5, 2.5, 4.5][c.k - 1]))
  assert mid["tree"].k == 2


def test_candidates_and_union():
  cands = costmodel.candidates(4, trees=True)
  assert [c.k for c in cands[:4]] == [1, 2, 3, 4] and Tree((4, 2, 1)) in cands
  assert costmodel.union(cands) == Tree((4, 2, 2))
  two = costmodel.candidates(2, trees=True)
  assert two and all(len(c.spec) < 2 for c in two)



def test_a_calls_fixed_part_pulls_the_speedup_towards_one():
  """S is the call's: (F1 + N T1) / (F + N / a T). A chain of 2 at a = 2 and 1.5x the cost
  gains 1.33 over its cycles; a prefill and call costing 10 plain steps on both sides leave
  (10 + 100) / (10 + 75) = 1.29, and 1,000 steps leave 1.02, under MIN_GAIN: plain decoding."""
  assert costmodel.call_speedup(2.0, 1.0, 1.5) == pytest.approx(4 / 3)
  assert costmodel.call_speedup(2.0, 1.0, 1.5, 100) == pytest.approx(4 / 3)
  assert costmodel.call_speedup(2.0, 1.0, 1.5, 100, 10.0, 10.0) == pytest.approx(110 / 85)
  probe, cands = costmodel.chain(2), costmodel.candidates(2, trees=False)
  hist = np.asarray([[0, 40]])  # every draft accepted: a = 2
  seconds = lambda c: (1.0, 1.0 if c.k == 1 else 1.5)
  for fixed, want in ((10.0, probe), (1000.0, costmodel.chain(1))):
    r = costmodel.choose(hist, probe, cands, seconds, max_new_tokens=100,
                         fixed=lambda c, f=fixed: (f, f))
    assert r["tree"] == want, r["table"]
    assert r["table"][1]["fixed_seconds"] == fixed


def test_bounds_prune_only_what_cannot_win():
  """auto times a window only where it could win: a candidate's S is at most its a with the floor
  window's time (the chain of the fewest heads, which every window's work contains) x
  BOUND_SLACK. Drafts accepted to depth 1 only: a(chain 2) = 2, deeper chains no more; with the
  floor at 1.5x a one-token forward, chain 2's bound is 2 / (1.5 x 0.9) = 1.48 (kept), and at 3x
  it is 0.74 (pruned, like every candidate)."""
  probe = costmodel.chain(4)
  cands = costmodel.candidates(4, trees=False)
  assert costmodel.floor_window(cands) == costmodel.chain(2)
  assert costmodel.floor_window(cands[:1]) is None
  hist = np.asarray([[0, 40, 0, 0]])  # every cycle: one draft accepted, the next refused
  a_of = costmodel.predicted_a(hist, probe, cands)
  b = costmodel.bounds(a_of, (1.0, 1.5))
  assert set(b) == set(cands[1:]) and b[costmodel.chain(2)] == pytest.approx(2 / 1.35)
  assert b[costmodel.chain(4)] == pytest.approx(2 / 1.35)  # as many tokens, the same floor
  low = costmodel.bounds(a_of, (1.0, 3.0))
  assert all(s < costmodel.MIN_GAIN for s in low.values())
  # choose with the pruned ones untimed: their rows carry the bound and no S; plain wins
  seconds = lambda c: (1.0, 1.0 if c.k == 1 else None)
  picked = costmodel.choose(hist, probe, cands, seconds, bound=low)
  assert picked["tree"] == costmodel.chain(1) and picked["S_predicted"] == 1.0
  assert [row["S_predicted"] for row in picked["table"]] == [1.0, None, None, None]
  assert picked["table"][1]["S_bound"] == pytest.approx(2 / 2.7)
  # the dynamic tree, where no static tree was timed: a at most DYNAMIC_A_HEADROOM x, k at most
  a, s = costmodel.dynamic_bound(1.2, 4, (1.0, 1.5))
  assert a == pytest.approx(1.2 * costmodel.DYNAMIC_A_HEADROOM)
  assert s == pytest.approx(a / 1.35)
  assert costmodel.dynamic_bound(3.5, 4, (1.0, 1.5))[0] == 4.0


def test_cycle_and_fixed_by_hand_and_never_below_zero():
  """A cycle is the median over rounds of (whole - short) per extra cycle; the fixed part is the
  short run's median beyond its cycles. Where jitter hides the cycles (whole no slower than the
  short run: CI measured -0.09 ms on a tiny model) the whole call counts as cycles, never a
  negative time the cost model would divide by."""
  # rounds of (short s, its cycles, whole s, its cycles): cycle 0.01 s, fixed 0.02 s
  timed = [(0.06, 4, 0.18, 16), (0.07, 4, 0.20, 16), (0.06, 4, 0.19, 16)]
  cycle, fixed = costmodel.cycle_and_fixed(timed)
  assert cycle == pytest.approx((0.19 - 0.06) / 12) and fixed == pytest.approx(0.06 - 4 * cycle)
  # the short run's cycles cost more than it took: no negative fixed part
  assert costmodel.cycle_and_fixed([(0.01, 4, 0.13, 16)]) == (pytest.approx(0.01), 0.0)
  # jitter: the whole call no slower than the short run
  cycle, fixed = costmodel.cycle_and_fixed([(0.0050, 12, 0.0049, 32), (0.0051, 12, 0.0050, 32)])
  assert cycle == pytest.approx(np.median([0.0049, 0.0050]) / 32) and fixed == 0.0
