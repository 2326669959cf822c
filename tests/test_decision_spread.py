"""experiments/decision_spread.py's summary on hand-made decisions (its whole run on a trained
tiny model: tests/integration/test_experiment_scripts.py)."""

import numpy as np
import pytest

from experiments import decision_spread


def decision(rounds, plain_ms, s4, chose):
  """Heads 1..4's predicted S s4, heads 1..2's 1.0; the probe's call follows plain's pace at
  half its log slope."""
  return {"probe_rounds": rounds, "chose": chose, "decision_seconds": 1.0,
          "S_predicted": {1: 1.0, 2: 1.0, 4: s4}, "plain_call_seconds": plain_ms / 1e3,
          "probe_call_seconds": np.sqrt(plain_ms) / 1e3}


def test_the_spread_and_its_tie_to_plain_decodings_pace_by_hand():
  ds = [decision(3, 100, 1.0, 1), decision(21, 100, 1.0, 1), decision(3, 150, 1.3, 4),
        decision(21, 120, 1.02, 4), decision(3, 200, 1.6, 4), decision(21, 90, 0.98, 1)]
  s = decision_spread.summarize(ds, 4)
  three, many = s["3"], s["21"]
  assert three["chose"] == {1: 1, 4: 2} and many["chose"] == {1: 2, 4: 1}
  assert three["S_predicted"][4]["mean"] == pytest.approx(1.3)
  assert three["S_predicted"][4]["sd"] == pytest.approx(0.3)
  assert three["plain_call_seconds"] == pytest.approx([0.1, 0.2])
  assert three["r_S_with_plain_call"] > 0.99 and three["p"] < 0.1
  assert three["probe_call_follows"] == pytest.approx(0.5)
  assert 0 < s["levene_p"] < 1  # the two spreads, 0.3 against 0.02, compared
