"""Speed-ups that mean what they say (mtp_jax.decoding.speed): a warm-up per mode, >= 3 interleaved
timed calls, a median ratio with a noise band, "about the same" inside it; the demo report reads the
verdict from bench_decode's records."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mtp_jax.decoding import speed

from experiments import demo_report


def test_speed_compare_reports_a_band_and_about_the_same():
  same = speed.compare([1.0, 1.3, 1.1], [1.05, 0.95, 1.2])  # identical work, noisy machine
  assert same["verdict"] == "about the same" and same["band"][0] < 1 < same["band"][1]
  assert "about the same as plain decoding" in speed.line(same)
  fast = speed.compare([2.0, 2.2, 2.1], [1.0, 1.1, 1.05])
  assert fast["verdict"] == "faster" and fast["speedup"] == pytest.approx(2.1 / 1.05)
  assert speed.compare([1.0, 1.1, 1.0], [2.0, 2.1, 2.2])["verdict"] == "slower"
  calls = []
  timed = speed.time_modes({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")})
  # a warm-up each, then 3 timed calls each, interleaved, each round starting one mode later
  assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
  assert [len(t["seconds"]) for t in timed.values()] == [3, 3]
  with pytest.raises(ValueError, match="--reps"):
    speed.time_modes({"a": lambda: None}, reps=2)


def test_time_modes_sets_each_round_and_keeps_each_calls_forwards():
  """on_round(i) runs before timed round i (not before the warm-ups), so every mode of a round
  sees what it set (bench_decode: round i's sampling seed); each timed call's forwards and
  tokens_per_forward are kept where its result has them."""
  import types
  seed, seen = {"now": 0}, []

  def run(name):
    seen.append((name, seed["now"]))
    return types.SimpleNamespace(seconds=0.1, forwards=10 + seed["now"],
                                 tokens_per_forward=1.0 + seed["now"] / 10)
  timed = speed.time_modes({"a": lambda: run("a"), "b": lambda: run("b")}, 3,
                           on_round=lambda i: seed.update(now=i + 1))
  assert seen == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]
  assert timed["a"]["forwards"] == timed["b"]["forwards"] == [11, 12, 13]
  assert timed["a"]["tokens_per_forward"] == pytest.approx([1.1, 1.2, 1.3])
  assert timed["a"]["seconds"] == [0.1] * 3


def record(S, band, variant="chain:4", heads=4, tree=None):
  return {"mode": "greedy", "sampling": None, "variant": variant, "heads": heads, "tree": tree,
          "auto": {"S_predicted": 1.0} if variant == "auto" else None, "batch": 1,
          "prompt_len": 64, "tokens_per_row": 64, "a": 2.5, "acceptance_by_position": [0.5],
          "identical": True, "forward_1_seconds": 1e-3, "forward_k_seconds": 2e-3,
          "S_measured": S, "S_band": band, "verdict": speed.compare(
              [band[0], S, band[1]], [1.0, 1.0, 1.0])["verdict"], "reps": 3,
          "S_predicted": 1.2, "off_by": 0.1}


def test_demo_report_says_about_the_same_inside_the_band():
  summary = {"step": 400, "n_params": 1, "n_future": 4, "head_kind": "parallel"}
  text = demo_report.report(summary, [record(1.00004, [0.9, 1.1]), record(1.4, [1.3, 1.5]),
                                      record(1.0, [0.95, 1.05], "auto", 1)])
  assert "noise band 0.90-1.10 over 3 timed calls each: about the same as plain decoding" in text
  assert "noise band 1.30-1.50 over 3 timed calls each: faster than plain decoding" in text
  assert "auto, chose plain decoding (head 1)" in text


def test_demo_report_ends_on_where_speculation_pays():
  """The closing lines: the best S measured here, the cost model's verdict (S predicted > 1 for
  chain:4 only), and the compiler's estimate on a v5e chip: a_batch / (Tk/T1) = 2.4 / 2.0."""
  summary = {"step": 400, "n_params": 1, "n_future": 4, "head_kind": "parallel"}
  rows = [dict(record(1.4, [1.3, 1.5]), a_batch=2.4),
          dict(record(0.9, [0.8, 0.95], "tree:4,2,1", 4, "4,2,1"), S_predicted=0.9)]
  aot = {"device_kind": "TPU v5 lite", "compiler": "XLA:TPU",
         "runs": [{"batch": 1, "k": 4, "Tk_over_T1": 2.0}, {"batch": 8, "k": 4, "Tk_over_T1": 3.0}]}
  text = demo_report.report(summary, rows, aot)
  assert text.splitlines()[-3] == "== where speculation pays =="
  assert "best S measured 1.40 (band 1.30-1.50, chain:4)" in text
  assert "says speculation pays on this machine for chain:4 greedy" in text
  assert text.splitlines()[-1].endswith("Tk/T1 = 2.00 for this model's shape at batch 1, so the "
                                        "a = 2.40 measured here would give S = 1.20 with 4 heads")
  assert "TPU v5 lite (XLA:TPU's compile-time estimate, not a measurement)" in text
  none = demo_report.report(summary, [record(1.0, [0.9, 1.1], "auto", 1)])
  assert none.splitlines()[-1].startswith("== where speculation pays: auto kept plain")


def test_demo_report_shows_alpha_k_teacher_forced_and_measured():
  summary = {"step": 400, "n_params": 1, "n_future": 3, "head_kind": "parallel",
             "eval/head1_loss": 1.0, "eval/head2_loss": 2.0, "eval/head3_loss": 2.5,
             "eval/head1_acc": 0.6, "eval/head2_acc": 0.5, "eval/head3_acc": 0.4,
             "eval/head1_agree": 1.0, "eval/head2_agree": 0.6, "eval/head3_agree": 0.5,
             "eval/head1_alpha_greedy": 1.0, "eval/head2_alpha_greedy": 0.6,
             "eval/head3_alpha_greedy": 0.5, "eval/head1_alpha_sampled": 1.0,
             "eval/head2_alpha_sampled": 0.7, "eval/head3_alpha_sampled": 0.4,
             "eval/a_bound_greedy": 1.9, "eval/a_bound_sampled": 1.98}
  text = demo_report.report(summary, [dict(record(0.9, [0.8, 0.95]), alpha_by_position=[0.5])])
  assert ("teacher-forced alpha_k greedy, heads 2-3 (P(draft k accepted | drafts < k)): "
          "0.600  0.500; tokens per cycle they estimate 1.90") in text  # read under its old name
  assert "sampled, heads 2-3 (P(draft k accepted | drafts < k)): 0.700  0.400" in text
  assert "tokens per forward a = 2.50 (alpha_k measured 0.50)" in text


def test_paired_ci_narrows_with_calls_and_holds_the_median():
  import numpy as np
  rng = np.random.default_rng(1)
  base = list(1.0 + 0.2 * rng.random(40))
  other = [b / 1.5 * (1 + 0.1 * (rng.random() - 0.5)) for b in base]  # 1.5x faster, noisy
  few, many = speed.paired_ci(base[:5], other[:5]), speed.paired_ci(base, other)
  assert few[0] <= many[0] <= 1.5 <= many[1] <= few[1]
  assert many[1] - many[0] < few[1] - few[0] and many[1] - many[0] < 0.05
  c = speed.compare(base, other)
  assert c["ci"] == many and c["ci"][0] <= c["speedup"] <= c["ci"][1]


def test_calibration_judges_auto_against_the_best_variant_of_its_cell():
  """bench_decode's calibration: auto that kept plain decoding where chain:4 won does not hold
  (it is no longer held by definition); where every variant lost, plain is the best and auto
  at 0.97 of it holds; a bet whose prediction was 20% off is out of the cost model's 15%. auto's
  table is judged on every candidate that also ran as a fixed variant."""
  from experiments import decode_calibration

  def rec(variant, S, batch, heads, off_by_auto=None):
    r = dict(record(S, [S - 0.05, S + 0.05], variant, heads), batch=batch,
             S_ci=[S - 0.02, S + 0.02], S_ci_within_10pct=True)
    if variant == "auto":
      r.update(S_predicted_auto=1.0, off_by_auto=off_by_auto or 0.0)
      chain = {1: 1.3, 8: 0.5, 32: 1.44}[batch]  # predicted S of chain:4 (chain:2 at 32)
      r["auto"] = {"S_predicted": 1.0, "table": [
          {"tree": "", "heads": 1, "S_predicted": 1.0, "a_predicted": 1.0},
          {"tree": "1" if batch == 32 else "1,1,1", "heads": 2 if batch == 32 else 4,
           "S_predicted": chain, "a_predicted": 2.0}]}
      if batch == 8:  # a candidate auto did not time: its bound, against chain:2's clock
        r["auto"]["table"].append({"tree": "1", "heads": 2, "S_predicted": None,
                                   "S_bound": 0.7, "a_predicted": 1.1})
    return r
  cal = decode_calibration.calibration([
      rec("chain:4", 1.4, 1, 4), rec("auto", 1.0, 1, 1),      # kept plain, chain:4 won
      rec("chain:4", 0.6, 8, 4), rec("chain:2", 0.65, 8, 2),
      rec("auto", 0.97, 8, 1),                                 # every variant lost
      rec("chain:2", 1.2, 32, 2), rec("auto", 1.19, 32, 2, off_by_auto=0.2)])["greedy"]
  by_batch = {a["batch"]: a for a in cal["auto"]}
  assert (by_batch[1]["best_variant"], by_batch[1]["holds"]) == ("chain:4", False)
  assert by_batch[1]["auto_over_best"] == pytest.approx(1.0 / 1.4)
  assert (by_batch[8]["best_variant"], by_batch[8]["S_best"], by_batch[8]["holds"]) == (
      "plain", 1.0, True)
  assert by_batch[8]["cost_model_within_15pct"] is None  # no bet, nothing predicted to judge
  assert by_batch[32]["holds"] and by_batch[32]["cost_model_within_15pct"] is False
  assert cal["auto_holds"] is False
  cands = {a["batch"]: a["candidates"] for a in cal["auto"]}
  assert [c["variant"] for c in cands[1] + cands[8] + cands[32]] == ["chain:4", "chain:4",
                                                                     "chain:2"]
  assert [round(c["off_by"], 3) for c in cands[1] + cands[8] + cands[32]] == [
      round(1.3 / 1.4 - 1, 3), round(0.5 / 0.6 - 1, 3), 0.2]
  assert (cal["candidates_compared"], cal["candidates_within_15pct"]) == (3, 1)
  assert (cal["predicted_speculation"], cal["predicted_speculation_within_15pct"]) == (2, 1)
  assert cands[8] and by_batch[8]["bounds"] == [
      {"variant": "chain:2", "S_bound": 0.7, "S_measured": 0.65, "held": True}]
  assert (cal["bounds_held"], cal["bounds_compared"]) == (1, 1)


def test_calibration_says_within_the_noise_where_the_clock_cannot_tell():
  """auto at 0.90 of the best variant misses where their paired rounds agree (each round's
  best/auto ratio near 0.90) and is within the noise where they scatter across 0.95; a bet
  predicted 20% over the clock is within the noise where S's interval reaches 15%, and misses
  where the interval is tight."""
  from experiments import decode_calibration

  def cell(spread):  # each round: plain 1.2 s, chain:2 1.0 s, auto 1/0.9 s +- spread
    plain = dict(greedy_seconds_all=[1.2] * 9)
    best = dict(record(1.2, [1.1, 1.3], "chain:2", 2), **plain, speculative_seconds_all=[1.0] * 9)
    auto = dict(record(1.08, [1.0, 1.2], "auto", 2), **plain, S_predicted_auto=1.3,
                off_by_auto=1.3 / 1.08 - 1,
                speculative_seconds_all=list(1 / 0.9 + np.linspace(-spread, spread, 9)))
    return decode_calibration.calibration([best, auto])["greedy"]

  tight, noisy = cell(0.01), cell(0.2)
  for cal, verdict in ((tight, "misses"), (noisy, "within the noise")):
    (a,) = cal["auto"]
    assert a["auto_over_best"] == pytest.approx(0.9) and not a["holds"]
    assert (a["judged"], a["cost_model_judged"]) == (verdict, verdict)
    assert a["cost_model_within_15pct"] is False
    assert cal["judged"][verdict] == cal["cost_model_judged"][verdict] == 1
  assert noisy["auto"][0]["auto_over_best_ci"][1] >= 0.95 > tight["auto"][0][
      "auto_over_best_ci"][1]
  assert decode_calibration.judged(0.96, None, 0.95) == "holds"


def test_bench_decode_flags_fail_first_and_png_prefix_defaults_to_the_json(tmp_path, monkeypatch):
  """A path as --png_prefix, or a mode not greedy or sampled, is one error line naming the flag,
  before any work; without the flag, --replot's PNGs take the JSON's name (a run never
  overwrites another's decode_*.png)."""
  from experiments import bench_decode
  with pytest.raises(SystemExit, match="--png_prefix: a file name prefix, not a path"):
    bench_decode.main(["--workdir", "x", "--png_prefix", "out/grid_"])
  for bad in (["--modes", "greedy,beam"], ["--modes", "sampled", "--temperature", "0"]):
    with pytest.raises(SystemExit, match="--modes: greedy, sampled or both"):
      bench_decode.main(["--workdir", "x", *bad])
  with pytest.raises(SystemExit, match="--seeds: rotate or fixed"):
    bench_decode.main(["--workdir", "x", "--seeds", "random"])
  with pytest.raises(Exception) as both:  # both modes in either order, temperature 0: greedy
    bench_decode.main(["--workdir", str(tmp_path / "none"), "--modes", "sampled,greedy",
                       "--temperature", "0"])
  assert "--modes" not in str(both.value)
  seen = {}
  monkeypatch.setattr(bench_decode, "plots",
                      lambda records, png_dir, prefix: seen.update(dir=png_dir, prefix=prefix))
  path = tmp_path / "grid_epyc.json"
  path.write_text("[]")
  bench_decode.main(["--replot", str(path)])
  assert seen == {"dir": str(tmp_path), "prefix": "grid_epyc_"}
  # Records: --replot writes their calibration again, with their machine (not this one's).
  auto = dict(record(1.0, [0.9, 1.1], "auto", 1), S_ci=[0.98, 1.02], S_predicted_auto=1.0,
              off_by_auto=0.0, machine={"cpu": "elsewhere"})
  path.write_text(json.dumps([dict(record(1.2, [1.1, 1.3], "chain:2", 2),
                                   machine=auto["machine"]), auto]))
  bench_decode.main(["--replot", str(path)])
  cal = json.loads((tmp_path / "grid_epyc_calibration.json").read_text())
  assert cal["machine"] == {"cpu": "elsewhere"}
  assert cal["greedy"]["auto"][0]["best_variant"] == "chain:2"


def test_bench_decode_plots_a_grid_of_sampled_cells_alone(tmp_path):
  """A grid run with --modes sampled has no greedy cell: its speed-up plot shows the sampled
  ones (it raised on zero columns before)."""
  from experiments import bench_decode
  bench_decode.plots([dict(record(1.2, [1.1, 1.3], "chain:2", 2), mode="sampled")], str(tmp_path),
                     "g_")
  assert (tmp_path / "g_speedup.png").stat().st_size > 0


def test_crossfit_chooses_the_best_on_the_other_rounds_by_hand():
  """Three rounds: chain:2 is the best by all three (S 1 / 0.9), so auto, as fast as plain
  decoding, is 0.9 of it. Without round 0 chain:2's median is 1.05 (plain is best), without round
  1 it is 1.0 (a tie keeps plain), without round 2 0.85 (chain:2, whose call of round 2 took 1.2
  s): the per-round ratios are 1, 1, 1.2 and their median 1."""
  from experiments import decode_calibration
  cf = decode_calibration.crossfit_over_best([1.0, 1.0, 1.0], {"chain:2": [0.8, 0.9, 1.2]},
                                             [1.0, 1.0, 1.0])
  assert cf["value"] == pytest.approx(1.0) and cf["best"] == {"plain": 2, "chain:2": 1}
  assert cf["ci"][0] <= 1.0 <= cf["ci"][1]
  assert decode_calibration.crossfit_over_best([1.0, 1.0], {"chain:2": None}, [1.0, 1.0]) is None


def test_the_largest_of_noisy_S_fails_a_perfect_decider_and_the_crossfit_does_not():
  """Five variants as fast as plain decoding, every call 6.5% noisy (an S then spreads by
  about 3%, as plain decoding against itself did on this VM), 15 rounds: auto, which ran plain
  decoding, is truly as fast as the best. Against the largest measured S it looks about 3%
  slower on average and misses 0.95 in more cells; against the best chosen on the other rounds
  it is unbiased. Where chain:2 is truly 1.2x faster the cross-fit
  chooses it and auto, still plain, is 1 / 1.2 of it."""
  from experiments import decode_calibration
  rng = np.random.default_rng(0)
  calls = lambda scale=1.0: list(scale * np.exp(0.065 * rng.standard_normal(15)))
  over_max, over_cf = [], []
  for _ in range(60):
    plain, auto = calls(), calls()
    fixed = {f"v{j}": calls() for j in range(5)}
    best = max([1.0] + [np.median(plain) / np.median(v) for v in fixed.values()])
    over_max.append(np.log(np.median(plain) / np.median(auto) / best))
    over_cf.append(np.log(decode_calibration.crossfit_over_best(plain, fixed, auto)["value"]))
  assert np.mean(over_max) < -0.015 and abs(np.mean(over_cf)) < 0.01
  assert np.mean(np.exp(over_max) < 0.95) > np.mean(np.exp(over_cf) < 0.95)
  plain = calls()
  cf = decode_calibration.crossfit_over_best(plain, {"chain:2": calls(1 / 1.2)}, calls())
  assert cf["best"] == {"chain:2": 15} and cf["value"] == pytest.approx(1 / 1.2, rel=0.04)


def test_pace_drift_summary_by_hand():
  """Two repetitions at log S +0.1 and -0.1, each interval +-1.96 x 0.05 in log: the weighted
  mean is S 1, Cochran's Q = 2 x (0.1 / 0.05)^2 = 8 on 1 degree of freedom, and both intervals
  miss the mean; the probe read both 5% (in log) high, the cost model 10% low."""
  from scipy import stats

  from experiments import pace_drift
  row = lambda x: {"S": np.exp(x), "S_ci": [np.exp(x - 1.96 * 0.05), np.exp(x + 1.96 * 0.05)],
                   "S_probe": np.exp(x + 0.05), "S_predicted": np.exp(x - 0.1)}
  s = pace_drift.summarize([row(0.1), row(-0.1)])
  assert s["S_weighted_mean"] == pytest.approx(1.0)
  assert s["cochran_q"] == pytest.approx(8.0) and s["q_p"] == pytest.approx(stats.chi2.sf(8, 1))
  assert s["intervals_missing_the_mean"] == 2 and s["se_log_S_within_mean"] == pytest.approx(0.05)
  assert s["log_probe_over_S_mean"] == pytest.approx(0.05) and s["probe_t_p"] is None
  assert s["log_predicted_over_S_mean"] == pytest.approx(-0.1) and s["predicted_t_p"] is None
  assert s["sd_log_S_between"] == pytest.approx(np.std([0.1, -0.1], ddof=1))


def test_pace_drift_longer_probe_by_hand():
  """A probe run past PROBE_ROUNDS: its reading from all rounds against S beside the first
  rounds'. Errors in log -0.2, 0, +0.2 from the first rounds and -0.1, 0, +0.1 from all: the sd
  halves; the sum and difference of the two are then perfectly correlated (Pitman-Morgan's r 1)."""
  from experiments import pace_drift
  row = lambda x: {"S": 1.0, "S_ci": [0.9, 1.1], "S_probe": 1.0, "S_predicted": np.exp(x),
                   "S_predicted_all_rounds": np.exp(x / 2)}
  s = pace_drift.summarize([row(-0.2), row(0.0), row(0.2)])
  assert s["log_predicted_over_S_sd"] == pytest.approx(0.2)
  assert s["log_predicted_all_rounds_over_S_sd"] == pytest.approx(0.1)
  assert s["log_predicted_all_rounds_over_S_mean"] == pytest.approx(0.0, abs=1e-12)
  assert s["sd_pitman_morgan_p"] == pytest.approx(0.0, abs=1e-6)
  plain = {k: v for k, v in row(0.1).items() if k != "S_predicted_all_rounds"}
  assert "log_predicted_all_rounds_over_S_sd" not in pace_drift.summarize([plain, plain])
