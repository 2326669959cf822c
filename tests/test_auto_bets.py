"""auto's bets (`session.Session._decide`, `_dynamic`, `_held_out`): a pick read from one probe
of its own loop is probed there again and chosen on the two probes' mean (`session.BET_PROBES`),
every would-be bet is checked on its own loop (docs/decoding.md, "Bets probed twice"), and a
bet's S is reported from one more probe, one the choice did not use ("A reading the choice did
not use"). On a random 4-head model (conftest.tree_model), the costs forced
(conftest.force_costs) or the probes faked."""

import numpy as np
import pytest

from conftest import force_costs, tree_model
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.decoding import probes as probes_lib
from mtp_jax.decoding import session as session_lib
from mtp_jax.decoding import timing_cache
from mtp_jax.decoding import tree as tree_lib
from test_tree import MAX_NEW, PAD, RAGGED


@pytest.fixture(scope="module")
def model():
  """Parallel heads' (the choice is the cost model's, the same for every kind)."""
  return tree_model("parallel")


def test_a_dynamic_bet_is_probed_twice(model, monkeypatch):
  """tree=auto's dynamic tree, where its first probe says it wins, is probed again and chosen on
  the two probes' mean (a bet on one probe's draw is a bet on its noise): a first draw at S 2
  and a second at S 0.02 average under MIN_GAIN, so plain decoding is kept; two draws at S 2
  bet on it; a first draw that loses is not probed again. Every window costs one plain step and
  accepts nothing (a 1) but the dynamic tree (a 2: the one read from a probe of its own, by
  depth as the chain of k; the union probe's candidates are read from the union)."""
  args, params = model
  cm, draws, n = decode_lib.costmodel, [], args.n_future
  monkeypatch.setattr(cm, "predict_a", lambda hist, probe, cand, **kw: 2.0 if (
      probe == cand == cm.chain(n)) else 1.0)
  force_costs(monkeypatch, lambda t: 1.0, lambda t: draws.pop(0) if isinstance(
      t, tree_lib.Dynamic) else 1.0)
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD, k="auto", tree="auto")
  for first, second, bet in ((1.0, 100.0, False), (1.0, 1.0, True), (100.0, None, False)):
    draws[:] = [first] + ([second] if second else []) + [4.0] * bet  # a held-out draw: S 0.5
    k, tree, auto = decode_lib.resolve(params, args, RAGGED, **kw)
    dyn, = [row for row in auto["table"] if row["tree"].startswith("dynamic")]
    assert not draws and dyn["probes"] == 1 + (second is not None), (first, second, dyn)
    mean = np.mean([first] + ([second] if second else []))
    assert dyn["forward_seconds"] == pytest.approx(mean)
    assert (tree is not None and tree.name == dyn["tree"]) == bet and (k == 1) == (not bet)
    # a bet's S is reported from a probe the choice did not use: it does not choose again
    assert auto["S_predicted"] == pytest.approx(0.5 if bet else 1.0)
    assert auto.get("S_chosen") == (pytest.approx(2.0) if bet else None)


def test_auto_bets_only_on_a_pick_read_twice(model, monkeypatch, tmp_path):
  """The forwards say every speculative candidate wins (a 2 at one plain step's cost); on their
  own loops all lose (100 steps) but the union probe's window (one step). auto checks would-be
  bets one by one, past VERIFY_PICKS (which bounds only the candidates near the bar), until one
  is read from two probes: the union tree. Its S is reported from a third probe (held out, its
  cycle 1.25 steps: S 1.6), which a second session reads from the disk cache (its own entry) and
  probes nothing. No decode runs (the probes are faked)."""
  args, params = model
  cm, probed, union_draws = decode_lib.costmodel, [], [1.0, 1.0, 1.25]
  monkeypatch.setattr(cm, "predict_a", lambda hist, probe, cand, **kw: 1.0 if cand.k == 1 else 2.0)
  force_costs(monkeypatch, lambda t: 1.0)
  union = cm.union(cm.candidates(args.n_future, True))
  fake = lambda tree, k: (probes_lib.Probe(np.ones((len(RAGGED), 8), np.int64), 10, 2.0),
                          probed.append((tree or cm.chain(k)).name) or (
                              1.0 if k == 1 else union_draws.pop(0) if tree == union else 100.0),
                          0.0)
  monkeypatch.setattr(session_lib.Session, "_run_probes",
                      lambda self, prompts, windows, **kw: [fake(*w) for w in windows])
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD, k="auto", tree="auto")
  k, tree, auto = decode_lib.resolve(params, args, RAGGED, **kw,
                                     disk=timing_cache.DiskCache(str(tmp_path)))
  assert tree == union and auto["S_chosen"] == pytest.approx(2.0)
  assert auto["S_predicted"] == auto["held_out"]["S_predicted"] == pytest.approx(1.6)
  rows = {row["tree"]: row for row in auto["table"]}
  assert rows[union.name]["probes"] == 2 and probed.count(union.name) == 3 and not union_draws
  checked = [name for name in dict.fromkeys(probed) if name not in ("", union.name)]
  assert len(checked) > session_lib.VERIFY_PICKS  # each a would-be bet, each lost
  assert all(rows[n]["probes"] == 1 and rows[n]["S_predicted"] < 1 for n in checked)
  seen = len(probed)
  warm = decode_lib.resolve(params, args, RAGGED, **kw, disk=timing_cache.DiskCache(str(tmp_path)))
  assert len(probed) == seen and warm[:2] == (k, tree) and warm[2]["measured_seconds"] == 0
  assert (warm[2]["S_predicted"], warm[2]["S_chosen"]) == (auto["S_predicted"], auto["S_chosen"])
