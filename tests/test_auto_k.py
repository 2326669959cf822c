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


def test_predict_a_pessimistic_by_hand():
  """z standard errors below each row's mean: the probe's error (n + PRIOR cycles) and a decode
  of max_new_tokens / a cycles; a row that always reaches the same depth has none."""
  probe, prior = costmodel.chain(3), costmodel.PRIOR
  sure = np.asarray([[0, 0, 12]])  # every cycle: both drafts
  assert costmodel.predict_a(sure, probe, probe, z=2.0, max_new_tokens=30) == pytest.approx(3.0)
  half = np.asarray([[6, 0, 6]])  # depth 0 or 2, half each: mean 1, variance 1
  se = np.sqrt(1.0 * (1 / (12 + prior) + 2.0 / 60))
  assert costmodel.predict_a(half, probe, probe) == pytest.approx(2.0)
  assert costmodel.predict_a(half, probe, probe, z=1.0, max_new_tokens=60) == pytest.approx(
      2.0 - se)
  assert costmodel.predict_a(half, probe, probe, z=1.0) == pytest.approx(
      2.0 - np.sqrt(1 / (12 + prior)))
  assert costmodel.predict_a(half, probe, probe, z=50.0) == 1.0  # never below plain's


def test_slowest_row_z_grows_with_the_batch():
  assert costmodel.slowest_row_z(1) == 1.0
  assert costmodel.slowest_row_z(2) == pytest.approx(1.1774, abs=1e-4)
  assert costmodel.slowest_row_z(8) == pytest.approx(np.sqrt(2 * np.log(8)))
  assert costmodel.slowest_row_z(32) > costmodel.slowest_row_z(8)


def test_pessimism_keeps_plain_where_the_mean_would_gamble():
  """A chain of 2 whose mean a (1.5) beats its cost (1.3) by 15%, on a probe of 4 cycles that
  split half and half: under z = 1 its a drops below 1.3 x MIN_GAIN, so plain decoding stays."""
  probe, cands = costmodel.chain(2), costmodel.candidates(2, trees=False)
  hist = np.asarray([[2, 2]])
  seconds = lambda c: (1.0, 1.0 if c.k == 1 else 1.3)
  assert costmodel.choose(hist, probe, cands, seconds)["tree"] == probe
  kept = costmodel.choose(hist, probe, cands, seconds, z=1.0, max_new_tokens=64)
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
  assert all(len(c.spec) < 2 for c in costmodel.candidates(2, trees=True))

