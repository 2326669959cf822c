"""Tree drafts (mtp_jax.decoding.tree): greedy tree decoding, static and dynamic, equals greedy
decoding token for token (parallel and projection heads, ragged prompts, EOS inside a tree,
accepted candidates that are not the heads' argmax), and so does the sampling program at
temperature 0; one tree forward against no-cache forwards of each root-to-node path; the
accepted path's KV entries, compacted, against a no-cache reference; a dynamic tree's nodes and
tables against enumeration; spec parsing and the fall-back (sequential heads). Sampled trees'
distribution: tests/test_sampling.py."""

from __future__ import annotations

import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import force_costs, random_params, tiny_config, tree_model
from mtp_jax import heads
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.decoding import tree as tree_lib
from mtp_jax.model import MTPModel, build_model, init_decode_cache

PAD, EOS = 59, 60
RAGGED = [[3], [9, 4, 12, 6, 33, 3], [5, 5, 2, 11, 0, 8, 13, 10, 2, 9, 1]]
MAX_NEW = 24


# Heavy tier: the projection heads' trees (~25 s of compiles); the tree code (drafts, window,
# acceptance, compaction) is the same for every kind that drafts trees, and runs on parallel
# heads in make test.
@pytest.fixture(scope="module", params=[k if k == "parallel" else pytest.param(
    k, marks=pytest.mark.heavy) for k in heads.tree_kinds()])
def model(request):
  return tree_model(request.param)


def test_tree_tables_by_hand():
  t = tree_lib.parse("2,1")
  tb = t.tables
  parent, depth, rank, anc, at_depth = tb.parent, tb.depth, tb.rank, tb.ancestors, tb.at_depth
  assert parent.tolist() == [0, 0, 0, 1, 2] and depth.tolist() == [0, 1, 1, 2, 2]
  assert rank.tolist() == [0, 0, 1, 0, 0] and t.n_nodes == 5 and t.k == 3
  assert anc[3].tolist() == [True, True, False, True, False]
  assert at_depth[4].tolist() == [0, 2, 4] and at_depth[1].tolist() == [0, 1, 1]
  assert t.bits().tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10101]
  assert tree_lib.parse("4,2,1").n_nodes == 21


@pytest.mark.parametrize("spec, match", [
    ("", "^tree: a comma-separated"), ("4,x", "^tree: a comma-separated"),
    ("0,1", "^tree: a comma-separated"), ("8,4", "at most 32"), ("2,1,1,1", "2..5"),
    ("dynamic:0", "^tree: dynamic:N takes N.*2..32, got 'dynamic:0'"),
    ("dynamic:1", "^tree: dynamic:N takes N"), ("dynamic:33", "^tree: dynamic:N takes N"),
    ("dynamic:x", "^tree: dynamic:N takes N.*got 'dynamic:x'"),
    ("dynamic", "^tree: dynamic:N takes N")])
def test_bad_tree_specs(spec, match):
  with pytest.raises(ValueError, match=match):
    tree_lib.parse(spec, n_future=4)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["4,2,1", "3,1", "dynamic:12"])
def test_tree_greedy_equals_greedy_ragged(model, spec):
  args, params = model
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD)
  g = decode_lib.plain(params, args, RAGGED, **kw)
  t = decode_lib.decode(params, args, RAGGED, tree=spec, **kw)
  np.testing.assert_array_equal(g.lengths, t.lengths)
  np.testing.assert_array_equal(g.tokens, t.tokens)
  assert t.tree == spec and t.heads == (4 if spec.startswith("dynamic") else
                                        len(spec.split(",")) + 1)
  if spec.startswith("dynamic"):  # drafts passed (the histogram is by depth)
    assert t.accepted_hist[1:].sum() > 0 and t.forwards < g.forwards, t.accepted_hist
  if spec == "4,2,1":
    # Some cycle accepted a candidate that was not its head's argmax (rank > 0): the tree did
    # more than the chain would have.
    rank = tree_lib.parse(spec).tables.rank
    assert t.rows_hist[:, rank > 0].sum() > 0, t.rows_hist
    assert t.forwards < g.forwards


@pytest.mark.slow
def test_tree_eos_inside_a_tree(model):
  """An EOS that head 1 emits inside an accepted path ends the row there."""
  args, params = model
  kw = dict(max_new_tokens=MAX_NEW, pad_id=PAD)
  g = decode_lib.plain(params, args, RAGGED, eos_id=-1, **kw)
  # Make the greedy output's 5th token of row 2 the EOS: the row must stop there.
  eos = int(g.tokens[2, 4])
  g = decode_lib.plain(params, args, RAGGED, eos_id=eos, **kw)
  t = decode_lib.decode(params, args, RAGGED, tree="4,2,1", eos_id=eos, **kw)
  np.testing.assert_array_equal(g.lengths, t.lengths)
  np.testing.assert_array_equal(g.tokens, t.tokens)
  assert t.lengths[2] <= 5 and t.tokens[2, t.lengths[2] - 1] == eos


@pytest.mark.slow
def test_tree_forward_and_compaction_against_no_cache_reference(model):
  """One tree forward: head outputs at every node equal a no-cache forward of the root-to-node
  path. Then the path to a chosen leaf is compacted, and a one-token cached step after it
  equals the no-cache forward of prompt + path + token: the cache holds exactly the path."""
  args, params = model
  m = MTPModel(args)
  tree = tree_lib.parse("2,2,1")
  depth, at_depth = tree.tables.depth, tree.tables.at_depth
  N = tree.n_nodes
  prompt = np.asarray([[5, 7, 1, 9, 2, 8]], np.int32)
  P = prompt.shape[1]
  rng = np.random.default_rng(0)
  toks = rng.integers(0, 50, size=(1, N)).astype(np.int32)
  cache = init_decode_cache(args, 1, P + N + 4)
  run = jax.jit(lambda t, p, c, seg: m.apply({"params": params}, t, seg, positions_BxS=p,
                                             cache=c, decoding=True))
  nocache = jax.jit(lambda t: m.apply({"params": params}, t)[0])
  _, cache = run(prompt[:, :P - 1], jnp.arange(P - 1)[None], cache, None)
  # The root is the prompt's last token, at position P - 1.
  toks[0, 0] = prompt[0, -1]
  base = jnp.asarray([P - 1])
  bits = jnp.asarray(tree.bits())[None]
  h_tree, cache = run(jnp.asarray(toks), base[:, None] + depth, cache, bits)
  for n in range(N):
    path = [int(at_depth[n, d]) for d in range(depth[n] + 1)]
    seq = np.concatenate([prompt[0, :P - 1], toks[0, path]])[None]
    np.testing.assert_allclose(h_tree[:, 0, n], nocache(jnp.asarray(seq))[:, 0, -1],
                               rtol=1e-5, atol=1e-5)
  leaf = N - 1  # the last leaf: its path is nodes 0, 2, 6, 10 (not the chain's 0, 1, 2, 3)
  path = at_depth[leaf]
  assert path.tolist() == [0, 2, 6, 10]
  cache = tree_lib.compact(cache, base, jnp.asarray(path)[None])
  nxt = np.asarray([[17]], np.int32)
  h_step, _ = run(jnp.asarray(nxt), base[:, None] + len(path), cache, None)
  seq = np.concatenate([prompt[0, :P - 1], toks[0, path], nxt[0]])[None]
  np.testing.assert_allclose(h_step[:, 0, 0], nocache(jnp.asarray(seq))[:, 0, -1], rtol=1e-5,
                             atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["4,2,1", "dynamic:9"])
def test_sampled_tree_at_temperature_zero_is_greedy(model, spec):
  """The sampling program of a tree (static or dynamic) at temperature 0 (any top-k, top-p,
  seed) is greedy decoding: head 1's p is then a point mass, and the rule follows its argmax."""
  args, params = model
  kw = dict(eos_id=-1, pad_id=PAD)
  g = decode_lib.plain(params, args, RAGGED, max_new_tokens=MAX_NEW, **kw)
  d = decode_lib.Decoder(params, args, k=4, batch=len(RAGGED), prompt_len=11,
                         max_new_tokens=MAX_NEW, sampling=True, tree=tree_lib.parse(spec, 4))
  r = d(RAGGED, temperature=0.0, top_k=3, top_p=0.5, seed=7, **kw)
  np.testing.assert_array_equal(g.tokens, r.tokens)
  assert r.tree == spec and r.forwards < g.forwards
  s = d(RAGGED, temperature=0.9, seed=7, **kw)  # and sampling runs the tree, not the chain
  assert s.tree == spec and (s.lengths == MAX_NEW).all()


def test_dynamic_tree_is_the_most_likely_paths():
  """draft_dynamic against enumeration: its N - 1 nodes are the N - 1 most likely paths of the
  heads' joint probability (all paths of up to 3 depths over a vocabulary of 5, enumerated), and
  its tables are those of that tree (parent, depth, ancestors as bits, the ancestor at each
  depth, children most likely first)."""
  rng = np.random.default_rng(0)
  D, V, N = 3, 5, 14
  lg = rng.normal(0, 1.5, (D, 2, V)).astype(np.float32)
  root = np.asarray([7, 9], np.int32)
  toks, t = jax.jit(tree_lib.draft_dynamic, static_argnums=2)(lg, root, N)
  toks, t = np.asarray(toks), jax.tree.map(np.asarray, t)
  logq = np.log(np.exp(lg) / np.exp(lg).sum(-1, keepdims=True))
  for b in range(2):
    paths = [p for d in range(1, D + 1) for p in itertools.product(range(V), repeat=d)]
    score = {p: sum(logq[j, b, x] for j, x in enumerate(p)) for p in paths}
    want = sorted(paths, key=lambda p: -score[p])[:N - 1]
    # node n's path: its ancestors' tokens from depth 1
    got = [tuple(toks[b, t.at_depth_BxNxK[b, n, 1:t.depth_BxN[b, n] + 1]]) for n in range(1, N)]
    assert sorted(got) == sorted(want) and toks[b, 0] == root[b]
    assert [score[p] for p in got] == sorted((score[p] for p in got), reverse=True)
    for n in range(1, N):
      par = t.parent_BxN[b, n]
      assert par < n and t.depth_BxN[b, n] == t.depth_BxN[b, par] + 1
      assert got[n - 1][:-1] == (got[par - 1] if par else ())
      anc = {n} | {int(a) for a in t.at_depth_BxNxK[b, n, :t.depth_BxN[b, n]]}
      assert int(np.uint32(t.bits_BxN[b, n].view(np.uint32))) == sum(1 << a for a in anc)
    for n in range(N):
      kids = [c for c in t.children_BxNxC[b, n] if c >= 0]
      assert kids == [m for m in range(1, N) if t.parent_BxN[b, m] == n]


@pytest.mark.slow
def test_tree_on_sequential_heads_is_a_chain(caplog):
  c = tiny_config("sequential", n_future=3)
  m = build_model(c)
  params = random_params(m)
  kw = dict(max_new_tokens=6, eos_id=-1, pad_id=PAD)
  with caplog.at_level(logging.WARNING, logger="mtp_jax.decoding.decode"):
    r = decode_lib.decode(params, m.args, [[1, 2]], tree="2,1", **kw)
  assert r.tree is None and "draft a chain" in caplog.text
  np.testing.assert_array_equal(r.tokens, decode_lib.plain(params, m.args, [[1, 2]], **kw).tokens)


def test_tree_auto_follows_the_cost_model(model, monkeypatch):
  """Every forward as cheap as one token: the largest predicted a wins, a tree (the random
  model's drafts pass at ranks > 0); the output is still greedy's."""
  args, params = model
  force_costs(monkeypatch, lambda t: 1.0)
  # The slowest row's mean a (no spread: the random model's a is ~1.1, within the spread of
  # plain's; tests/test_auto_k.py checks the expected slowest row by hand).
  predict_a = decode_lib.costmodel.predict_a
  monkeypatch.setattr(decode_lib.costmodel, "predict_a",
                      lambda *a, max_new_tokens=0: predict_a(*a))
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD)
  r = decode_lib.decode(params, args, RAGGED, k="auto", tree="auto", **kw)
  g = decode_lib.plain(params, args, RAGGED, **kw)
  np.testing.assert_array_equal(g.tokens, r.tokens)
  assert r.auto["probe"]["tree"] == "4,2,2" and r.tree is not None and r.tree == r.auto["tree"]
  timed = [row for row in r.auto["table"] if row["S_predicted"] is not None]
  best = max(timed, key=lambda row: row["S_predicted"])
  assert r.tree == best["tree"] and best["nodes"] > best["heads"]
  # A window not timed could not have won: its bound is under what was chosen.
  assert all(row["S_bound"] < best["S_predicted"] for row in r.auto["table"] if row not in timed)
  # The dynamic candidate, probed on its own, as many nodes as the best static tree.
  dyn, = [row for row in r.auto["table"] if row["tree"].startswith("dynamic")]
  static = max((row for row in r.auto["table"] if row["nodes"] > row["heads"] and row is not dyn),
               key=lambda row: row["S_bound"] if row["S_predicted"] is None else row["S_predicted"])
  assert dyn["tree"] == f"dynamic:{static['nodes']}" and dyn["a_predicted"] > 1


def test_auto_probes_a_candidate_near_the_bar(model, monkeypatch):
  """Every speculative candidate's a 2: the forwards put heads 1..2 at S 1.0, under MIN_GAIN
  (1.05) but within VERIFY_NEAR of it, and its own loop at S 2: auto probes it, then probes it
  again (a bet is read from two probes: BET_PROBES), bets on it (the others, at S 0.02, are
  not probed) and reads its S once more (HELD_OUT); the output is greedy's."""
  args, params = model
  cm, probed = decode_lib.costmodel, []
  monkeypatch.setattr(cm, "predict_a", lambda hist, probe, cand, **kw: 2.0 if cand.k > 1 else 1.0)
  force_costs(monkeypatch, lambda t: {1: 1.0, 2: 2.0}.get(t.k, 100.0),
              lambda t: probed.append(t.name) or {1: 1.0, 2: 1.0}.get(t.k, 100.0))
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD)
  r = decode_lib.decode(params, args, RAGGED, k="auto", **kw)
  np.testing.assert_array_equal(r.tokens, decode_lib.plain(params, args, RAGGED, **kw).tokens)
  assert probed == [cm.chain(args.n_future).name, "", "1", "", "1", "", "1", ""] and (
      r.heads == 2), (probed, r.auto)
  assert [row["probes"] for row in r.auto["table"]] == [0, 2] + [0] * (args.n_future - 3) + [1]
  assert r.auto["S_predicted"] == pytest.approx(2.0)


def test_sampled_tree_auto_reads_chains_from_a_chain_probe(model, monkeypatch):
  """Sampled, a chain draws its drafts from the heads and a tree takes their top ranks, so a
  tree's walk does not give a chain's acceptance: tree=auto probes the chain of k beside the
  union tree, and chains take their a (and their loop's factor, and fixed part) from it, trees
  from the union's. Greedy, one probe serves both (a greedy walk is the same either way)."""
  args, params = model
  cm, probed = decode_lib.costmodel, []
  from_chain = lambda probe, cand: not tree_lib.is_tree(probe) and not tree_lib.is_tree(cand)
  monkeypatch.setattr(cm, "predict_a", lambda hist, probe, cand, **kw: 1.0 if cand.k == 1 else (
      float(cand.k) if from_chain(probe, cand) else 1.2))
  force_costs(monkeypatch, lambda t: 1.0,
              lambda t: probed.append(t.name) or (2.0 if t == cm.chain(4) else 1.0))
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD, k="auto", tree="auto")
  r = decode_lib.decode(params, args, RAGGED, temperature=1.0, seed=5, **kw)
  assert probed[:3] == ["4,2,2", "", "1,1,1"], probed
  rows = {row["tree"]: row for row in r.auto["table"]}
  for k in (2, 3, 4):  # chains: a from the chain probe, T its cycle (2.0) x forward time (1.0)
    row = rows[cm.chain(k).name]  # (3 heads, a 3, cannot beat 4 heads' S 2: not timed)
    assert row["a_predicted"] == row["a_mean"] == k, row
    assert row["forward_seconds"] == (None if k == 3 else 2.0), row
  assert rows["4,2,2"]["a_predicted"] == 1.2 and rows["4,2,2"]["forward_seconds"] == 1.0
  assert r.heads == 4 and r.tree is None and r.auto["chain_probe"]["loop_factor"] == 2.0
  probed.clear()
  g = decode_lib.decode(params, args, RAGGED, **kw)
  assert probed[:2] == ["4,2,2", ""] and "1,1,1" not in probed[2:3] and "chain_probe" not in g.auto
  rows = {row["tree"]: row for row in g.auto["table"]}  # (a pick probed on its own loop aside)
  assert rows["1,1,1"]["a_predicted"] == rows["4,2,2"]["a_predicted"] == 1.2, rows


def test_tree_auto_times_only_windows_that_could_win(model, monkeypatch):
  """Every window but one token's 10x as costly: no candidate's bound (its a with the floor
  window's time) reaches MIN_GAIN, so only T1, the probe's window and the floor are timed, the
  dynamic tree is not probed (its row holds its bound), and plain decoding runs."""
  args, params = model
  timed = force_costs(monkeypatch, lambda t: 1.0 if t.k == 1 else 10.0)
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD)
  r = decode_lib.decode(params, args, RAGGED, k="auto", tree="auto", **kw)
  np.testing.assert_array_equal(r.tokens, decode_lib.plain(params, args, RAGGED, **kw).tokens)
  chain = decode_lib.costmodel.chain
  assert r.heads == 1 and sorted(t.name for t in timed) == sorted(
      [chain(1).name, chain(2).name, "4,2,2"])
  rows = {row["tree"]: row for row in r.auto["table"]}
  assert rows["4,2,2"]["S_predicted"] < 1 and rows["2,1"]["S_predicted"] is None
  dyn, = [row for name, row in rows.items() if name.startswith("dynamic")]
  assert dyn["S_predicted"] is None and dyn["S_bound"] < decode_lib.costmodel.MIN_GAIN
  assert all(row["S_bound"] < decode_lib.costmodel.MIN_GAIN for row in rows.values()
             if row["S_predicted"] is None)


@pytest.mark.slow
def test_forward_times_run_every_window_in_a_compiled_loop(model):
  """The cost model's inputs (costmodel.forward_times): the chain of 1, a chain and a tree, each
  run inside a compiled loop at two trip counts (the tree with its mask); a time per window,
  none under a window it holds, kept per shape by a decode.Session (bounded, holding the params
  it timed)."""
  args, params = model
  chain = decode_lib.costmodel.chain
  windows = [chain(1), chain(3), tree_lib.parse("2,1")]
  session = decode_lib.Session(params, args, cache_size=1)
  t = session.forward_times(windows, batch=2, context=8, reps=2)
  assert list(t) == windows and all(np.isfinite(s) and s > 0 for s in t.values())
  assert min(t[chain(3)], t[windows[2]]) >= t[chain(1)]
  assert session.forward_times(windows, batch=2, context=8, reps=2) == t
  session.forward_times(windows[:1], batch=2, context=9, reps=2)  # evicts the first shape
  assert len(session._forward) == 1


def test_windows_timed_later_join_their_shapes_scale(monkeypatch):
  """A window timed after others of its shape is timed beside the largest of them and scaled by
  that one's time then and now: a machine running 2x slower the second time leaves S as it was.
  No window times under one it holds (costmodel.monotone)."""
  cm = decode_lib.costmodel
  chain, t21 = cm.chain, tree_lib.parse("2,1")
  assert cm.holds(t21, chain(2)) and cm.holds(chain(3), chain(1)) and not cm.holds(chain(2), t21)
  assert cm.monotone({chain(1): 2.0, chain(2): 1.5, t21: 1.0}) == {
      chain(1): 2.0, chain(2): 2.0, t21: 2.0}
  calls, slow = [], {"factor": 1.0}
  base = {chain(1): 1.0, chain(2): 1.4, chain(3): 1.7, t21: 2.0}

  def fake(params, args, trees, **kw):
    calls.append([t.name for t in trees])
    return {t: base[t] * slow["factor"] for t in trees}
  monkeypatch.setattr(cm, "forward_times", fake)
  session = decode_lib.Session({}, None)
  assert session.forward_times([chain(1), t21], batch=1, context=8) == {chain(1): 1.0, t21: 2.0}
  slow["factor"] = 2.0
  got = session.forward_times([chain(2), chain(3)], batch=1, context=8)
  assert calls[-1] == ["1", "1,1", "2,1"] and got == {chain(2): 1.4, chain(3): 1.7}


def test_a_dynamic_window_is_timed_beside_plain_decoding(model):
  """bench_decode times the window auto_tree chose, a dynamic tree too (costmodel.monotone once
  raised AttributeError on it there): by its node count and heads, dynamic:4 over heads 2..3
  holds the chain of 1 and 2-node static trees, not chain:4."""
  args, params = model
  cm, dyn = decode_lib.costmodel, tree_lib.Dynamic(4, 2)
  assert cm.holds(dyn, cm.chain(1)) and cm.holds(dyn, tree_lib.parse("2"))
  assert not cm.holds(dyn, cm.chain(4)) and cm.holds(tree_lib.parse("4,2,1"), dyn)
  assert cm.monotone({cm.chain(1): 2.0, dyn: 1.0}) == {cm.chain(1): 2.0, dyn: 2.0}
  got = cm.forward_seconds(params, args, 3, batch=1, context=8, reps=3, tree=dyn)
  assert got["forward_k"] >= got["forward_1"] > 0


def test_dynamic_tree_loop_sorts_no_vocabulary(model):
  """The dynamic tree's per-head candidates compile to TopK calls, not a sort of the vocabulary
  (one top_k over [heads, rows, V] indexed by depth afterwards was a full sort: 35 ms a cycle
  on SmolLM2's 49,152 ids). Read in the compiled program: no sort has V along an axis."""
  args, params = model
  dec = decode_lib.Decoder(params, args, k=4, batch=2, prompt_len=8, max_new_tokens=8,
                           tree=tree_lib.parse("dynamic:5"))
  sorts = [line for line in dec._compiled.as_text().splitlines() if " sort(" in line]
  assert sorts and not [s for s in sorts if f"{args.vocab_size}]" in s.split("sort(")[0]
                        or f",{args.vocab_size}" in s.split("sort(")[0]], sorts
