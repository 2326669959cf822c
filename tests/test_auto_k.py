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

