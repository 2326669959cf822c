"""experiments/calibration_over_runs.py: several bench_decode grids read together, on a
hand-worked example and on two committed grids (the script's whole run, no decoding)."""

import json
import os

import numpy as np
import pytest
from scipy import stats

from experiments import calibration_over_runs as over

RESULTS = os.path.join(os.path.dirname(__file__), "..", "experiments", "results")


def grid(chain2, auto_S, chose, predicted, own_loop):
  """One cell, greedy b1 p64: chain:2 as a fixed variant at S chain2; auto at S auto_S, having
  chosen `chose` heads, its table predicting chain:2 at `predicted` (T from its own loop or not)."""
  cell = {"mode": "greedy", "batch": 1, "prompt_len": 64}
  fixed = dict(cell, variant="chain:2", heads=2, tree=None, S_measured=chain2)
  auto = dict(cell, variant="auto", heads=chose, tree=None, S_measured=auto_S, auto={"table": [
      {"tree": "", "heads": 1, "nodes": 1, "S_predicted": 1.0, "a_predicted": 1.0},
      {"tree": "1", "heads": 2, "nodes": 2, "S_predicted": predicted, "a_predicted": 1.7,
       "own_loop": own_loop}]})
  return {("greedy", 1, 64): {"chain:2": fixed, "auto": auto}}


RUNS = [grid(1.10, 1.00, 1, 0.99, False),   # chain:2 won, auto kept plain decoding
        grid(1.02, 1.03, 2, 1.071, True),   # auto bet on chain:2
        grid(0.97, 0.96, 1, 0.8827, False)]  # chain:2 lost


def test_auto_against_the_best_and_the_leave_one_run_out_pick_by_hand():
  rows = over.against_best(RUNS)
  assert [round(r["auto_over_best"], 4) for r in rows] == [round(1 / 1.1, 4), round(1.03 / 1.02,
                                                                                    4), 0.96]
  # run 0: chain:2's mean over runs 1 and 2 is 0.995 < 1: plain (1 / 1.10 of the best); runs 1
  # and 2: chain:2's mean elsewhere 1.035 and 1.06: chain:2 (1.0 and 0.97 of the best)
  assert [r["pick"] for r in rows] == ["plain", "chain:2", "chain:2"]
  assert [round(r["pick_over_best"], 4) for r in rows] == [round(1 / 1.1, 4), 1.0, 0.97]
  s = over.summary(RUNS, before=RUNS[:2])
  assert (s["auto_holds"], s["auto_cells"], s["pick_holds"], s["pick_cells"]) == (2, 3, 2, 3)
  assert s["mcnemar_p"] is None  # no cell where one holds and the other does not
  assert s["plain_against_plain"]["n"] == 2
  assert s["plain_against_plain"]["mean"] == pytest.approx(0.98)
  assert (s["before"]["auto_holds"], s["before"]["auto_cells"]) == (1, 2)
  assert 0 < s["before"]["welch_p"] <= 1 and s["before"]["fisher_p"] == 1.0


def test_the_cost_models_bias_by_where_T_came_from_by_hand():
  groups = {g["T_from"]: g for g in over.bias(RUNS)}
  ratios = groups["forward ratios"]
  assert ratios["n"] == 2 and ratios["mean_log"] == pytest.approx(np.log(0.9 * 0.91) / 2)
  assert ratios["se"] == pytest.approx(abs(np.log(0.9 / 0.91)) / 2)
  assert groups["own loop"]["n"] == 1
  assert groups["own loop"]["mean_log"] == pytest.approx(np.log(1.071 / 1.02))


def test_two_committed_grids_read_together(tmp_path, capsys):
  """The script's run on two committed grids of the projection byte model: every auto record
  paired with a pick, the machine the runs', a PNG; a missing file is one line naming it."""
  names = [os.path.join(RESULTS, f"bench_decode_projection_bytes_beside_plain{s}_epyc.json")
           for s in ("", "_2")]
  out = over.main(names + ["--json", str(tmp_path / "o.json"), "--png", str(tmp_path / "o.png")])
  assert out["runs"] == 2 and out["auto_cells"] == out["pick_cells"] == 32
  assert 0 <= out["auto_holds"] <= 32 and out["bias"]
  assert out["crossfit"]["auto_cells"] == out["crossfit"]["pick_cells"] == 32
  assert sum(out["verdicts"]["judged"].values()) == sum(
      out["verdicts"]["judged_crossfit"].values()) == 32
  with open(names[0]) as f:
    assert out["machine"] == json.load(f)[0]["machine"]
  assert os.path.getsize(tmp_path / "o.png") > 0
  with pytest.raises(SystemExit):
    over.main(names[:1] + ["--before", str(tmp_path / "none.json")])
  assert "jsons: no file" in capsys.readouterr().err
  # read in part: sampled cells, auto_tree alone
  part = over.main(names + ["--modes", "sampled", "--autos", "auto_tree"])
  assert part["auto_cells"] == 8 and {r["mode"] for r in part["cells"]} == {"sampled"}
  assert {r["auto"] for r in part["cells"]} == {"auto_tree"}
  with pytest.raises(SystemExit):
    over.main(names + ["--modes", "beam"])
  assert "--modes: greedy and/or sampled" in capsys.readouterr().err


def test_the_bias_by_drafts_with_its_as_share_by_hand():
  """Grouped by mode, batch and drafts (chain:2 is a chain); a's share where the fixed variant
  measured its a (a_batch), here in one run of the three: log(1.7 / 1.5)."""
  runs = [grid(1.10, 1.00, 1, 0.99, False), grid(1.02, 1.03, 2, 1.071, True)]
  runs[1][("greedy", 1, 64)]["chain:2"]["a_batch"] = 1.5
  g, = over.bias_by_drafts(runs)
  key = (g["auto"], g["mode"], g["batch"], g["drafts"], g["n"])
  assert key == ("auto", "greedy", 1, "chain", 2)
  assert g["mean_log"] == pytest.approx((np.log(0.9) + np.log(1.071 / 1.02)) / 2)
  assert g["a"]["n"] == 1 and g["a"]["mean_log"] == pytest.approx(np.log(1.7 / 1.5))


def test_the_judgement_with_the_best_chosen_on_other_rounds_by_hand():
  """Run 0: chain:2's calls 0.8, 0.9, 1.2 s against plain decoding's 1 s; the best without each
  round is plain, plain (a tie), chain:2 (see tests/test_speed.py), so auto, which kept plain
  decoding, holds at 1.0, and the pick from run 1 (chain:2) at the median of 1 / 0.8, 1 / 0.9,
  1.2 / 1.2. Run 1: chain:2 at 0.5 s in every round is the best; auto kept plain decoding again
  (its calls 1, 1.05, 1 s; its decision's, plain decoding's, 1 s): 0.5 of it, where the pick
  (chain:2) holds. So the decision misses in one cell where the pick holds."""
  def cell(chain2, auto_calls):
    base = {"mode": "greedy", "batch": 1, "prompt_len": 64, "greedy_seconds_all": [1.0] * 3}
    fixed = dict(base, variant="chain:2", heads=2, tree=None, speculative_seconds_all=chain2,
                 S_measured=1.0 / float(np.median(chain2)))
    auto = dict(base, variant="auto", heads=1, tree=None, speculative_seconds_all=auto_calls,
                S_measured=1.0 / float(np.median(auto_calls)), auto={"table": []})
    return {("greedy", 1, 64): {"chain:2": fixed, "auto": auto}}

  runs = [cell([0.8, 0.9, 1.2], [1.0] * 3), cell([0.5] * 3, [1.0, 1.05, 1.0])]
  rows = over.against_best(runs)
  assert [r["choice"] for r in rows] == ["plain", "plain"]
  assert [r["pick"] for r in rows] == ["chain:2", "chain:2"]
  assert [r["auto_over_best_crossfit"] for r in rows] == pytest.approx([1.0, 0.5])
  assert [r["decision_over_best_crossfit"] for r in rows] == pytest.approx([1.0, 0.5])
  assert [r["pick_over_best_crossfit"] for r in rows] == pytest.approx([1 / 0.9, 1.0])
  assert rows[0]["auto_over_best"] == pytest.approx(0.9)  # against the largest S: misses
  cf = over.summary(runs)["crossfit"]
  assert (cf["auto_holds"], cf["decision_holds"], cf["pick_holds"]) == (1, 1, 2)
  assert (cf["only_decision_holds"], cf["only_pick_holds"], cf["mcnemar_p"]) == (0, 1, 1.0)
  assert cf["auto_over_best_mean_log"] == pytest.approx(np.log(0.5) / 2)


def test_the_cost_model_where_auto_bet_by_hand():
  """`bets`: auto's pick's log(S predicted / S measured) where it bet (+10% and +30% here; a
  record that kept plain decoding is not a bet), within 15% in one; --before compares them."""
  def run(predicted, measured, heads):
    rec = {"mode": "greedy", "batch": 1, "prompt_len": 64, "variant": "auto", "heads": heads,
           "tree": None, "S_predicted_auto": predicted, "S_measured": measured}
    return {("greedy", 1, 64): {"auto": rec}}

  runs = [run(1.10, 1.00, 2), run(1.30, 1.00, 4), run(1.00, 1.20, 1)]
  b = over.bets(runs)
  assert b["n"] == 2 and b["within_15pct"] == 1
  assert b["mean_log"] == pytest.approx((np.log(1.1) + np.log(1.3)) / 2)
  assert b["sd"] == pytest.approx(abs(np.log(1.3) - np.log(1.1)) / np.sqrt(2))
  assert over._bet_logs([run(1.0, 1.0, 2)]) == [0.0]


def test_bets_beside_the_S_their_choice_read_by_hand():
  """`bets`' "chosen": where a held-out probe predicted, the S the choice read (S_chosen_auto)
  beside it, and a record without one counts its prediction as what it was chosen on. Chosen
  at 1.3 and 1.2, held out at 1.1 and 1.05 (measured 1.0); a third record without a held-out
  probe at 1.2: the paired test takes the two held out only."""
  def run(predicted, chosen=None):
    rec = {"mode": "greedy", "batch": 1, "prompt_len": 64, "variant": "auto", "heads": 3,
           "tree": None, "S_predicted_auto": predicted, "S_measured": 1.0,
           **({"S_chosen_auto": chosen} if chosen else {})}
    return {("greedy", 1, 64): {"auto": rec}}

  b = over.bets([run(1.1, 1.3), run(1.05, 1.2), run(1.2)])
  assert b["n"] == b["chosen"]["n"] == 3 and b["held_out"] == 2
  assert b["mean_log"] == pytest.approx(np.log([1.1, 1.05, 1.2]).mean())
  assert b["chosen"]["mean_log"] == pytest.approx(np.log([1.3, 1.2, 1.2]).mean())
  assert (b["within_15pct"], b["chosen"]["within_15pct"]) == (2, 0)
  diffs = np.log([1.1 / 1.3, 1.05 / 1.2])
  t = diffs.mean() / (diffs.std(ddof=1) / np.sqrt(2))
  assert b["held_out_paired_p"] == pytest.approx(2 * stats.t.sf(abs(t), 1))
