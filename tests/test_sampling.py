"""Sampling and speculative sampling (mtp_jax.decoding.sampling, mtp_jax.decoding.decode with
temperature > 0).

The central check: speculative sampling with the MTP heads as drafts is distributed exactly as
plain sampling from head 1 (Leviathan et al. 2023, Theorem 1). On a random model with 8 tokens,
the exact distribution of the first three generated tokens is enumerated from head 1's
probabilities (teacher forcing every prefix), and thousands of speculative samples (rows of one
batch, one jit call) are compared with it by a chi-square test, for every head kind and with
top-k / top-p; the same test rejects two classic wrong rules. The same for sampled draft trees
(static and dynamic, every kind that drafts trees) and two wrong multi-draft rules. Also:
temperature 0 is greedy, and greedy equals a no-cache reference loop; seeds and rows; the rule
by hand; the CLI's checks.
"""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_model
from scipy import stats

from mtp_jax import heads
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.decoding import sampling
from mtp_jax.decoding import tree as tree_lib
from mtp_jax.model import logits

V, PAD, K, T = 8, 0, 3, 3  # vocabulary, pad id, heads used, generated tokens compared
PROMPT = [3, 1, 4]
N = 12000  # samples: rows of one batch
KINDS = ("parallel", "projection", "sequential")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def make(kind: str):
  c = tiny_config(kind, n_future=K)
  c.model.vocab_size = V
  m, params = tiny_model(c, seed=3)
  # A little sharper than the random init, so that drafts are often rejected and often accepted.
  params = jax.tree.map(lambda x: x * 1.3 if x.ndim == 2 else x, params)
  return m, params


def heavy(param):
  return pytest.param(param, marks=pytest.mark.heavy)


# Heavy tier for parallel and projection (~22 s): test_model checks each kind's cache against
# the full forward, and test_decode speculative = greedy per kind; the sequential chain, whose
# depths read drafts through the cache, stays in make test.
@pytest.fixture(scope="module", params=[k if k == "sequential" else heavy(k) for k in KINDS])
def model(request):
  return make(request.param)


def exact_distribution(m, params, sp: sampling.Settings) -> np.ndarray:
  """P(x1, x2, x3) of plain sampling from head 1 with the truncation sp: one full forward (no
  cache) over every continuation, head 1's distribution at each prefix."""
  seqs = np.asarray([PROMPT + list(x) for x in itertools.product(range(V), repeat=T)], np.int32)
  h_NxBxSxD, _ = jax.jit(lambda p, t: m.apply({"params": p}, t))(params, seqs)
  p_BxSxV = np.asarray(sampling.probs(logits(params, m.args, h_NxBxSxD[:1])[0], sp))
  P = len(PROMPT)
  prob = np.ones(len(seqs))
  for t in range(T):
    prob *= p_BxSxV[np.arange(len(seqs)), P - 1 + t, seqs[:, P + t]]
  return prob.reshape((V,) * T)


def chi2_pvalue(tokens_NxT, exact) -> float:
  """Pearson chi-square of observed triples against `exact`, cells with expected < 5 pooled."""
  flat = np.ravel_multi_index(tokens_NxT.T, exact.shape)
  observed = np.bincount(flat, minlength=exact.size).astype(float)
  expected = exact.ravel() * len(tokens_NxT)
  assert observed[expected == 0].sum() == 0, "a sample of probability 0 (truncated away)"
  big = expected >= 5
  obs = np.append(observed[big], observed[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  keep = exp > 0
  assert keep.sum() > 10, "too few cells: the test would say nothing"
  stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
  return float(stats.chi2.sf(stat, keep.sum() - 1))


def sample_rows(m, params, *, k, seed=0, n=N, **sp):
  decoder = decode_lib.Decoder(params, m.args, k=k, batch=n, prompt_len=len(PROMPT),
                               max_new_tokens=T, sampling=True)
  r = decoder([PROMPT] * n, eos_id=-1, pad_id=PAD, seed=seed, **sp)
  assert (r.lengths == T).all()
  return r


SETTINGS = [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=1.2, top_k=5, top_p=0.9)]


# Heavy tier: the parallel and projection kinds' chains (~20 s); the accept rule is the same code
# for every kind, the sequential chain (whose drafts read their predecessors') and the parallel
# heads' trees below check it in make test.
@pytest.mark.slow
@pytest.mark.parametrize("kind", [k if k == "sequential" else heavy(k) for k in KINDS])
def test_speculative_sampling_is_exact_in_distribution(kind):
  """Per head kind, plain truncation and top-k + top-p: p-value above 1e-3 (fixed seeds)."""
  m, params = make(kind)
  decoder = decode_lib.Decoder(params, m.args, k=K, batch=N, prompt_len=len(PROMPT),
                               max_new_tokens=T, sampling=True)
  for i, sp in enumerate(SETTINGS):
    r = decoder([PROMPT] * N, eos_id=-1, pad_id=PAD, seed=i, **sp)
    exact = exact_distribution(m, params, sampling.Settings(**sp))
    if sp["top_k"]:  # both truncations bind: fewer triples than top-k alone leaves
      assert 0 < (exact > 0).sum() < sp["top_k"] ** T
    pval = chi2_pvalue(r.tokens[:, :T], exact)
    assert pval > 1e-3, (m.args.head_kind, sp, pval)
    # Drafts are really accepted and really rejected: both branches of the rule are exercised.
    total = r.accepted_hist.sum()
    assert r.accepted_hist[0] > 0.05 * total and r.accepted_hist[1:].sum() > 0.05 * total, (
        r.accepted_hist)
    assert r.accepted_hist[-1] > 0.01 * total, r.accepted_hist  # the second draft too


@pytest.mark.slow
def test_plain_sampling_is_exact_in_distribution():
  m, params = make("parallel")  # head 1 alone: one kind is enough
  sp = SETTINGS[1]
  r = sample_rows(m, params, k=1, seed=5, **sp)
  assert chi2_pvalue(r.tokens, exact_distribution(m, params, sampling.Settings(**sp))) > 1e-3


REAL_ACCEPT = sampling.accept_sampled


def always_accept(drafts_BxK1, p_BxKxV, q_BxK1xV, u_BxK):
  m_B = jnp.full(drafts_BxK1.shape[:1], drafts_BxK1.shape[1])
  return m_B, sampling.draw(p_BxKxV[:, -1], u_BxK[:, -1])


def resample_from_p(drafts_BxK1, p_BxKxV, q_BxK1xV, u_BxK):
  """The right acceptance test, but at a rejection a draw from p instead of max(0, p - q)."""
  B, Kw, _ = p_BxKxV.shape
  pd = jnp.take_along_axis(p_BxKxV[:, :Kw - 1], drafts_BxK1[..., None], axis=-1)[..., 0]
  qd = jnp.take_along_axis(q_BxK1xV, drafts_BxK1[..., None], axis=-1)[..., 0]
  ok = (u_BxK[:, :Kw - 1] * qd < pd).astype(jnp.int32)
  m_B = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
  return m_B, sampling.draw(p_BxKxV[jnp.arange(B), m_B], u_BxK[:, -1])


def bonus_from_previous_slot(drafts_BxK1, p_BxKxV, q_BxK1xV, u_BxK):
  """The right rule, except that after every draft passed the bonus token is drawn from p one
  slot too early (the distribution of the last draft's position, not the next)."""
  B, Kw, _ = p_BxKxV.shape
  m_B, next_B = REAL_ACCEPT(drafts_BxK1, p_BxKxV, q_BxK1xV, u_BxK)
  wrong_B = sampling.draw(p_BxKxV[:, Kw - 2], u_BxK[:, -1])
  return m_B, jnp.where(m_B == Kw - 1, wrong_B, next_B)


# (wrong rule, heads, rows): each its own batch size, so each is traced afresh into its own
# program (decode's jit caches by shape, and a monkeypatched rule is not part of the key).
# make test keeps one wrong chain rule and one wrong tree rule to show the statistic's power;
# the heavy tier the others (~18 s).
WRONG = [(always_accept, K, N + 1),
         pytest.param(resample_from_p, K, N + 2, marks=pytest.mark.heavy),
         pytest.param(bonus_from_previous_slot, 2, N + 3, marks=pytest.mark.heavy)]


@pytest.mark.slow
@pytest.mark.parametrize("wrong, k, n", WRONG, ids=["always_accept", "resample_from_p",
                                                     "bonus_from_previous_slot"])
def test_chi_square_rejects_a_wrong_rule(monkeypatch, wrong, k, n):
  """The tests above have power: the same statistic at the same sample size rejects wrong rules;
  a counter shows the wrong rule was traced into the program that produced the samples."""
  m, params = make("parallel")
  calls = []

  def counted(*a):
    calls.append(1)
    return wrong(*a)

  monkeypatch.setattr(sampling, "accept_sampled", counted)
  sp = SETTINGS[0]
  r = sample_rows(m, params, k=k, n=n, **sp)
  assert calls, "the wrong rule was never traced: the samples came from a cached program"
  if k == 2:  # the bonus token is inside the statistic: drafts fully accepted often enough
    assert r.accepted_hist[1] > 0.2 * r.accepted_hist.sum(), r.accepted_hist
  assert chi2_pvalue(r.tokens, exact_distribution(m, params, sampling.Settings(**sp))) < 1e-6


@pytest.mark.slow
def test_bonus_token_is_inside_the_statistic():
  """k = 2 over the first three tokens: the first comes from prefill, the first cycle gains the
  accepted draft and then the bonus token, so a bonus token drawn from p after a full acceptance
  is one of the three tokens tested (with k = 3 it would be the fourth, outside)."""
  m, params = make("parallel")
  sp = SETTINGS[1]
  r = sample_rows(m, params, k=2, seed=11, **sp)
  assert r.accepted_hist[1] > 0.2 * r.accepted_hist.sum(), r.accepted_hist
  assert chi2_pvalue(r.tokens, exact_distribution(m, params, sampling.Settings(**sp))) > 1e-3


# Sampled trees (parallel and projection heads): a static tree and a dynamic one, the same
# statistic against the same enumerated distribution, and two wrong multi-draft rules rejected.
TREES = ("3,2", "dynamic:7")


def sample_tree_rows(m, params, spec, *, n=N, seed=0, **sp):
  tree = tree_lib.parse(spec, K)
  decoder = decode_lib.Decoder(params, m.args, k=K, batch=n, prompt_len=len(PROMPT),
                               max_new_tokens=T, sampling=True, tree=tree)
  r = decoder([PROMPT] * n, eos_id=-1, pad_id=PAD, seed=seed, **sp)
  assert (r.lengths == T).all() and r.tree == tree.name
  return r


# Heavy tier: the projection kind's trees (~14 s); the parallel heads' trees stay in make test.
@pytest.mark.slow
@pytest.mark.parametrize("kind", [k if k == "parallel" else heavy(k) for k in heads.tree_kinds()])
def test_sampled_trees_are_exact_in_distribution(kind):
  """Per kind that drafts trees, a static and a dynamic tree, with top-k + top-p: p-value above
  1e-3 (fixed seeds); siblings past the first are really accepted, and whole paths rejected."""
  m, params = make(kind)
  sp = SETTINGS[1]
  exact = exact_distribution(m, params, sampling.Settings(**sp))
  for i, spec in enumerate(TREES):
    r = sample_tree_rows(m, params, spec, seed=20 + i, **sp)
    pval = chi2_pvalue(r.tokens[:, :T], exact)
    assert pval > 1e-3, (kind, spec, pval)
    total = r.accepted_hist.sum()
    assert r.accepted_hist[0] > 0.05 * total and r.accepted_hist[1:].sum() > 0.05 * total, (
        r.accepted_hist)
    if spec[0].isdigit():  # a static tree: the histogram is by node, its rank known
      rank = tree_lib.parse(spec).tables.rank
      assert r.rows_hist[:, rank > 0].sum() > 0.05 * total, r.rows_hist.sum(0)


# (wrong setting of accept_tree, rows): each its own batch size, so each is traced afresh.
WRONG_TREE = [pytest.param("parent", N + 4, marks=pytest.mark.heavy), ("p", N + 5)]


@pytest.mark.slow
@pytest.mark.parametrize("wrong, n", WRONG_TREE, ids=["parent", "p"])
def test_chi_square_rejects_a_wrong_tree_rule(monkeypatch, wrong, n):
  """The tree test has power: siblings tested against the parent's p (never renormalised after a
  rejection), or the token after rejected siblings drawn from p instead of the residual, fail
  the same statistic at the same sample size."""
  m, params = make("parallel")
  real, calls = sampling.accept_tree, []

  def patched(*a, **kw):
    calls.append(1)
    return real(*a, **kw, _wrong=wrong)

  monkeypatch.setattr(sampling, "accept_tree", patched)
  sp = SETTINGS[1]
  r = sample_tree_rows(m, params, TREES[0], n=n, seed=20, **sp)
  assert calls, "the wrong rule was never traced: the samples came from a cached program"
  pval = chi2_pvalue(r.tokens, exact_distribution(m, params, sampling.Settings(**sp)))
  assert pval < 1e-6, pval

# (name, drafts, uniforms (accept d1, accept d2, draw), (m, next))
RAGGED = [[3], [5, 1, 7, 2, 6, 4], [2, 2]]
MAX_NEW = 8


def reference_greedy(m, params, prompts, max_new):
  """Full forward over the growing sequence (no cache), head 1's argmax at the last token."""
  L = max(len(p) for p in prompts) + max_new
  fwd = jax.jit(lambda p, t: logits(p, m.args, m.apply({"params": p}, t)[0][:1])[0])
  seqs = np.full((len(prompts), L), PAD, np.int32)
  lens = np.asarray([len(p) for p in prompts])
  for b, p in enumerate(prompts):
    seqs[b, :len(p)] = p
  for _ in range(max_new):
    lg = np.asarray(fwd(params, seqs))
    nxt = lg[np.arange(len(prompts)), lens - 1].argmax(-1)
    seqs[np.arange(len(prompts)), lens] = nxt
    lens = lens + 1
  return np.stack([seqs[b, len(p):len(p) + max_new] for b, p in enumerate(prompts)])


@pytest.mark.slow
def test_greedy_equals_no_cache_reference_and_temperature_zero(model):
  m, params = model
  want = reference_greedy(m, params, RAGGED, MAX_NEW)
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD)
  for k in (1, K):
    np.testing.assert_array_equal(decode_lib.decode(params, m.args, RAGGED, k=k, **kw).tokens,
                                  want)
  # The sampling program at temperature 0 (any top-k, top-p, seed) is greedy too.
  sampler = decode_lib.Decoder(params, m.args, k=K, batch=3, prompt_len=6,
                               max_new_tokens=MAX_NEW, sampling=True)
  r = sampler(RAGGED, eos_id=-1, pad_id=PAD, temperature=0.0, top_k=3, top_p=0.5, seed=7)
  np.testing.assert_array_equal(r.tokens, want)


@pytest.mark.slow
def test_seeds_and_rows():
  m, params = make("sequential")
  kw = dict(max_new_tokens=MAX_NEW, eos_id=-1, pad_id=PAD, k=K, temperature=1.0)
  prompts = decode_lib.repeat([[3, 1], [5]], 4)
  assert prompts == [[3, 1]] * 4 + [[5]] * 4
  a = decode_lib.decode(params, m.args, prompts, seed=0, **kw)
  b = decode_lib.decode(params, m.args, prompts, seed=0, **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)  # same seed, same output
  assert len({tuple(row) for row in a.tokens[:4]}) == 4  # the samples of a prompt differ
  c = decode_lib.decode(params, m.args, prompts, seed=1, **kw)
  assert not np.array_equal(a.tokens, c.tokens)
  # Row 0's sample depends on (seed, row 0, its prompt), not on the other rows or batch size.
  other = decode_lib.decode(params, m.args, [[3, 1], [7, 7], [2]], seed=0, **kw)
  alone = decode_lib.decode(params, m.args, [[3, 1]], seed=0, **kw)
  np.testing.assert_array_equal(other.tokens[0], a.tokens[0])
  np.testing.assert_array_equal(alone.tokens[0], a.tokens[0])


@pytest.mark.parametrize("kw, flag", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(seed=-1), "seed"),
])
def test_bad_sampling_arguments(kw, flag):
  m, params = make("projection")
  with pytest.raises(ValueError, match=f"^{flag}: "):
    decode_lib.decode(params, m.args, [[1]], k=2, max_new_tokens=2, eos_id=-1, pad_id=PAD, **kw)
  with pytest.raises(ValueError, match="^num_samples: "):
    decode_lib.repeat([[1]], 0)


# The generate CLI: sampling flags end to end, and bad input as one line, exit 2, nothing printed.

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  from mtp_jax import convert
  c = tiny_config("sequential", n_future=3)
  c.model.vocab_size = 259  # the byte tokenizer
  _, params = tiny_model(c)
  wd = str(tmp_path_factory.mktemp("gen") / "wd")
  convert.write_workdir(wd, c, params)
  return wd


# Heavy tier: the generate CLI sampling (~12 s of subprocess and compiles); its flags' checks
# (test_generate_bad_input_one_line_exit_2) and the CLI in both modes greedy (test_train.py) stay.
@pytest.mark.heavy
@pytest.mark.slow
def test_generate_cli_samples_in_both_modes(workdir):
  p = subprocess.run([sys.executable, "-m", "mtp_jax.generate", "--workdir", workdir,
                      "--prompt", "def f(", "--prompt", "x", "--max_new_tokens", "8", "--mode",
                      "both", "--temperature", "0.8", "--top_p", "0.95", "--num_samples", "3",
                      "--seed", "1"], env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  # Both modes' samples, labelled: 2 prompts x 3 samples x 2 modes.
  assert p.stdout.count("--- prompt") == 12, p.stdout
  assert "--- prompt 2, sample 3 (plain sampling)\n" in p.stdout
  assert "--- prompt 2, sample 3 (speculative sampling)\n" in p.stdout
  assert "speculative: tokens 48 forwards" in p.stdout and "plain: tokens 48" in p.stdout
  assert "sampled (temperature 0.8): tokens/forward speculative" in p.stdout
  assert "identical" not in p.stdout  # sampled modes are compared by speed, not tokens
  assert "noise band" in p.stdout and "timed calls each, after a warm-up" in p.stdout


@pytest.mark.parametrize("args, flag", [
    (["--temperature", "-1"], "--temperature"), (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"), (["--top_p", "0"], "--top_p"),
    (["--top_p", "1.01"], "--top_p"), (["--top_k", "-2"], "--top_k"),
    (["--num_samples", "0"], "--num_samples"), (["--seed", "-5"], "--seed"),
    (["--prompt", "x" * 30, "--max_new_tokens", "8"], "--max_new_tokens"),  # max_len is 32
])
def test_generate_bad_input_one_line_exit_2(workdir, capsys, args, flag):
  from mtp_jax import generate
  generate.FLAGS.unparse_flags()
  generate.FLAGS(["generate", "--workdir", workdir, "--prompt", "x", *args])
  with pytest.raises(SystemExit) as e:
    generate.main([])
  cap = capsys.readouterr()
  assert e.value.code == 2 and cap.out == ""
  assert len(cap.err.strip().splitlines()) == 1 and cap.err.startswith(f"error: {flag}: "), cap.err
