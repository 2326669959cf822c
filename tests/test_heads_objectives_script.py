"""experiments/heads_objectives.py without training: its flags, the run configs it trains (one
per objective and seed), the aggregation over seeds and the verdict against the seed spread."""

from __future__ import annotations

import pytest

from experiments import heads_objectives as ho
from tests.conftest import tiny_config


def test_defaults_plan_sixteen_runs_and_smoke_keeps_explicit_flags():
  a = ho.parse_args(["--source", "S", "--root", "R"])
  assert (a.arms, a.data, a.seeds) == (list(ho.OBJECTIVES), list(ho.DATA), [0, 1])
  assert len(a.arms) * len(a.data) * len(a.seeds) == 16
  assert (a.steps, a.batch_size, a.seq_len, a.lr, a.batches) == (150, 8, 128, 1e-3, [1, 8])
  s = ho.parse_args(["--source", "S", "--root", "R", "--smoke", "--steps", "4"])
  assert (s.steps, s.seeds, s.n_prompts, s.batches) == (4, [0], 2, [1, 2])  # 8 clipped to 2


@pytest.mark.parametrize("argv", [["--arms", "ce,nope"], ["--data", "web"], ["--seeds", "0,x"],
                                  ["--n_prompts", "12", "--batches", "1,8"], []])
def test_bad_flags_are_parser_errors(argv):
  with pytest.raises(SystemExit):
    ho.parse_args((["--source", "S", "--root", "R"] if argv else []) + argv)


def test_run_config_sets_the_objective_and_the_seed(tmp_path):
  args = ho.parse_args(["--source", "S", "--root", str(tmp_path)])
  c = tiny_config(n_future=4)
  c.model.max_len = 256  # the script's seq_len 128
  seen = {}
  for name in ho.OBJECTIVES:
    for seed in (0, 1):
      r = ho.run_config(c, str(tmp_path / "base"), args, name, seed)
      assert (r.optim.trainable, r.train.steps, r.data.shuffle_seed) == ("heads", 150, seed)
      assert r.train.init_from == str(tmp_path / "base")
      seen[name, seed] = (r.loss.draft_objective, r.loss.head_curriculum)
  assert seen["ce", 1] == ("ce", 0.0) and seen["tv", 0] == ("tv", 0.0)
  assert seen["kl_to_head1", 0] == ("kl_to_head1", 0.0)
  assert seen["ce+curriculum", 0] == ("ce", 0.5)
  d = ho.run_config(c, "b", args, "ce", 0, files="/x/tokens-*.array_record")
  assert (d.data.corpus, d.data.files) == ("array_record", "/x/tokens-*.array_record")


def _run(objective, data, seed, a):
  return {"objective": objective, "data": data, "seed": seed,
          "eval": {"alpha_greedy": [1.0, 0.5, 0.4]},
          "decode": {"sampled_b1": {"a": a, "alpha_by_position": [0.5, 0.4]}}}


def test_aggregate_and_verdict_against_the_seed_spread():
  runs = [_run("ce", "stdlib", 0, 1.50), _run("ce", "stdlib", 1, 1.54),
          _run("tv", "stdlib", 0, 1.70), _run("tv", "stdlib", 1, 1.72),  # lead 0.19 > 0.04
          _run("ce", "distilled", 0, 2.0), _run("ce", "distilled", 1, 2.2),
          _run("kl_to_head1", "distilled", 0, 1.9), _run("kl_to_head1", "distilled", 1, 2.5),
          _run("ce+curriculum", "distilled", 0, 1.0), _run("ce+curriculum", "distilled", 1, 1.0)]
  arms = ho.aggregate(runs)
  f = arms["tv|stdlib"]["figures"][ho.VERDICT_METRIC]
  assert f["mean"] == pytest.approx(1.71) and f["spread"] == pytest.approx(0.02)
  assert f["std"] == pytest.approx(0.0141421, rel=1e-4) and f["n"] == 2
  assert arms["ce|distilled"]["figures"]["tf/alpha_greedy"]["mean"] == [1.0, 0.5, 0.4]
  old = dict(runs[0], eval={"a_bound_sampled": 1.9})  # scored before the estimate's rename
  assert ho.flatten(old)["tf/a_estimate_teacher_forced_sampled"] == 1.9
  lines = ho.verdict(arms)
  assert lines[0].startswith("stdlib: best decode/sampled_b1/a is tv")
  assert "exceeds the seed-to-seed spread" in lines[0]
  assert lines[1].startswith("distilled: best decode/sampled_b1/a is kl_to_head1")  # 2.2 > 2.1
  assert lines[1].endswith("within the noise")  # lead 0.1 against a spread of 0.6
  ce_best = ho.verdict(ho.aggregate(runs[:2] + runs[-2:]))  # ce on stdlib, curriculum distilled
  assert len(ce_best) == 2, ce_best
  assert ce_best[0].startswith("stdlib: best decode/sampled_b1/a is ce (1.520")
  assert ce_best[0].endswith("; ce is the best")
  assert ce_best[1].startswith("distilled: best decode/sampled_b1/a is ce+curriculum")
  assert ce_best[1].endswith("; no ce arm to compare")
  one_seed = ho.verdict(ho.aggregate([runs[0], runs[2]]))
  assert one_seed[0].endswith("within the noise")  # one seed: no spread to compare with
  table = ho.table(arms, None)
  assert table.count("\n") == len(arms) + 2 and "| tv|stdlib | 0.500 / 0.400 |" in table
