"""Sampling and speculative sampling (mtp_jax.sampling, mtp_jax.decode with temperature > 0).

The central check: speculative sampling with the MTP heads as drafts is distributed exactly as
plain sampling from head 1 (Leviathan et al. 2023, Theorem 1). On a random model with 8 tokens,
the exact distribution of the first three generated tokens is enumerated from head 1's
probabilities (teacher forcing every prefix), and thousands of speculative samples (rows of one
batch, one jit call) are compared with it by a chi-square test, for every head kind and with
top-k / top-p; the same test rejects two classic wrong rules. Also: temperature 0 is greedy, and
greedy equals a no-cache reference loop; seeds and rows; the rule by hand; the CLI's checks.
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

from mtp_jax import decode as decode_lib
from mtp_jax import sampling
from mtp_jax.model import logits

V, PAD, K, T = 8, 0, 3, 3  # vocabulary, pad id, heads used, generated tokens compared
PROMPT = [3, 1, 4]
N = 12000  # samples: rows of one batch
KINDS = ("parallel", "projection", "sequential")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def make(kind: str):
  c = tiny_config(kind, n_future=K)
  c.model.vocab_size = V
  m, params = tiny_model(c, seed=3)
  # A little sharper than the random init, so that drafts are often rejected and often accepted.
  params = jax.tree.map(lambda x: x * 1.3 if x.ndim == 2 else x, params)
  return m, params


@pytest.fixture(scope="module", params=KINDS)
def model(request):
  return make(request.param)


def exact_distribution(m, params, sp: sampling.Params) -> np.ndarray:
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


def test_speculative_sampling_is_exact_in_distribution(model):
  """Per head kind, plain truncation and top-k + top-p: p-value above 1e-3 (fixed seeds)."""
  m, params = model
  decoder = decode_lib.Decoder(params, m.args, k=K, batch=N, prompt_len=len(PROMPT),
                               max_new_tokens=T, sampling=True)
  for i, sp in enumerate(SETTINGS):
    r = decoder([PROMPT] * N, eos_id=-1, pad_id=PAD, seed=i, **sp)
    exact = exact_distribution(m, params, sampling.Params(**sp))
    if sp["top_k"]:  # both truncations bind: fewer triples than top-k alone leaves
      assert 0 < (exact > 0).sum() < sp["top_k"] ** T
    pval = chi2_pvalue(r.tokens[:, :T], exact)
    assert pval > 1e-3, (m.args.head_kind, sp, pval)
    # Drafts are really accepted and really rejected: both branches of the rule are exercised.
    total = r.accepted_hist.sum()
    assert r.accepted_hist[0] > 0.05 * total and r.accepted_hist[1:].sum() > 0.05 * total, (
        r.accepted_hist)
    assert r.accepted_hist[-1] > 0.01 * total, r.accepted_hist  # the second draft too


def test_plain_sampling_is_exact_in_distribution():
  m, params = make("parallel")  # head 1 alone: one kind is enough
  sp = SETTINGS[1]
  r = sample_rows(m, params, k=1, seed=5, **sp)
  assert chi2_pvalue(r.tokens, exact_distribution(m, params, sampling.Params(**sp))) > 1e-3


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
WRONG = [(always_accept, K, N + 1), (resample_from_p, K, N + 2),
         (bonus_from_previous_slot, 2, N + 3)]


@pytest.mark.parametrize("wrong, k, n", WRONG, ids=[w[0].__name__ for w in WRONG])
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
  assert chi2_pvalue(r.tokens, exact_distribution(m, params, sampling.Params(**sp))) < 1e-6


def test_bonus_token_is_inside_the_statistic():
  """k = 2 over the first three tokens: the first comes from prefill, the first cycle gains the
  accepted draft and then the bonus token, so a bonus token drawn from p after a full acceptance
  is one of the three tokens tested (with k = 3 it would be the fourth, outside)."""
  m, params = make("parallel")
  sp = SETTINGS[1]
  r = sample_rows(m, params, k=2, seed=11, **sp)
  assert r.accepted_hist[1] > 0.2 * r.accepted_hist.sum(), r.accepted_hist
  assert chi2_pvalue(r.tokens, exact_distribution(m, params, sampling.Params(**sp))) > 1e-3


# accept_sampled by hand. V = 3, k = 3: drafts d1, d2 drawn from q1, q2; head 1's p at slots 0..2.
P3 = [[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]]
Q2 = [[0.25, 0.75, 0.0], [0.5, 0.5, 0.0]]
# (name, drafts, uniforms (accept d1, accept d2, draw), (m, next))
RULE_CASES = [
    # p0(0)/q1(0) = 2: always accepted; p1(1)/q2(1) = 0.6: u = 0.5 accepts; bonus from p2 = {2}.
    ("both_accepted", [0, 1], [0.99, 0.5, 0.3], (2, 2)),
    # d2 rejected (u = 0.7 >= 0.6): residual max(0, p1 - q2) = (0, 0, 0.5) -> token 2.
    ("second_rejected", [0, 1], [0.99, 0.7, 0.0], (1, 2)),
    # p0(1)/q1(1) = 2/3: u = 0.7 rejects; residual (0.25, 0, 0) -> token 0 whatever u.
    ("first_rejected", [1, 1], [0.7, 0.0, 0.99], (0, 0)),
    ("first_accepted_at_two_thirds", [1, 0], [0.6, 0.1, 0.0], (2, 2)),
    # p1(0)/q2(0) = 0.4: u = 0.39 accepts, 0.41 rejects -> residual (0, 0, 0.5): token 2.
    ("ratio_below_one", [0, 0], [0.0, 0.39, 0.0], (2, 2)),
    ("ratio_below_one_rejected", [0, 0], [0.0, 0.41, 0.0], (1, 2)),
]


def test_accept_sampled_hand_worked_cases():
  names, drafts, u, want = zip(*RULE_CASES)
  B = len(names)
  m, nxt = sampling.accept_sampled(np.asarray(drafts, np.int32),
                                   np.broadcast_to(np.float32(P3), (B, 3, 3)),
                                   np.broadcast_to(np.float32(Q2), (B, 2, 3)),
                                   np.asarray(u, np.float32))
  for name, w, got in zip(names, want, zip(np.asarray(m).tolist(), np.asarray(nxt).tolist())):
    assert got == w, (name, got, w)
  # Gained tokens: d1..dm, then next.
  np.testing.assert_array_equal(
      sampling.gained(np.asarray([[5, 6], [5, 6], [5, 6]], np.int32), np.asarray([0, 1, 2]),
                      np.asarray([9, 9, 9])), [[9, 9, 9], [5, 9, 9], [5, 6, 9]])


def test_draw_and_truncation_by_hand():
  p = np.float32([[0.1, 0.0, 0.6, 0.3]])
  # cumulative 0.1, 0.1, 0.7, 1.0: u picks the first token whose cumulative mass exceeds u.
  got = [int(sampling.draw(p, np.float32([u]))[0]) for u in (0.0, 0.099, 0.101, 0.69, 0.71, 0.9999)]
  assert got == [0, 0, 2, 2, 3, 3]  # token 1, of mass 0, never
  lg = np.log(np.float32([[0.5, 0.2, 0.15, 0.1, 0.05]]))
  sp = lambda t, k, p: sampling.Params(np.float32(t), np.int32(k), np.float32(p))
  np.testing.assert_allclose(sampling.probs(lg, sp(1, 0, 1)), [[0.5, 0.2, 0.15, 0.1, 0.05]],
                             rtol=1e-6)
  np.testing.assert_allclose(sampling.probs(lg, sp(1, 2, 1)), [[5 / 7, 2 / 7, 0, 0, 0]], rtol=1e-6)
  # top_p 0.8: mass before each token 0, 0.5, 0.7, 0.85: the first three stay.
  np.testing.assert_allclose(sampling.probs(lg, sp(1, 0, 0.8)), [[0.5 / 0.85, 0.2 / 0.85,
                                                                   0.15 / 0.85, 0, 0]], rtol=1e-6)
  # top-k first, then top-p on the renormalised rest: 5/7 >= 0.7 alone.
  np.testing.assert_allclose(sampling.probs(lg, sp(1, 2, 0.7)), [[1, 0, 0, 0, 0]], rtol=1e-6)
  # temperature 2: p ~ sqrt(p); temperature 0: one-hot on the argmax.
  s = np.sqrt([0.5, 0.2, 0.15, 0.1, 0.05])
  np.testing.assert_allclose(sampling.probs(lg, sp(2, 0, 1))[0], s / s.sum(), rtol=1e-5)
  np.testing.assert_array_equal(sampling.probs(lg, sp(0, 3, 0.5)), [[1, 0, 0, 0, 0]])


def reference_probs(logits_V, temperature, top_k, top_p):
  """NumPy, float64, written from the definition: temperature 0 is a one-hot on the (first)
  argmax; else softmax(logits / temperature); top-k keeps the tokens at least as likely as the
  k-th most likely (ties with it kept); the rest is renormalised; top-p keeps each token whose
  more likely tokens (strictly) hold less than top_p of that mass (so ties stay together);
  renormalised again."""
  x = np.asarray(logits_V, np.float64)
  if temperature == 0:
    return np.eye(len(x))[int(np.argmax(x))]
  z = x / temperature
  keep = np.ones(len(x), bool)
  if top_k > 0:
    keep = z >= np.sort(z)[::-1][min(top_k, len(x)) - 1]
  w = np.where(keep, np.exp(z - z.max()), 0.0)
  w /= w.sum()
  if top_p < 1:
    before = np.array([w[w > wi].sum() for wi in w])
    keep &= before < top_p
    w = np.where(keep, w, 0.0)
    w /= w.sum()
  return w


PROB_CASES = [  # (logits, temperature, top_k, top_p)
    ([0.3, -1.2, 2.0, 0.0, 1.1], 0.7, 0, 1.0),  # temperature alone
    ([2.0, 1.0, 1.0, 0.0, -1.0], 1.0, 2, 1.0),  # top-k 2, tie at the boundary: 3 kept
    ([1.0, 1.0, 0.0, 0.0, -1.0], 1.0, 0, 0.5),  # top-p: the tied pair together
    ([2.0, 1.0, 1.0, 0.0, -3.0], 1.0, 2, 0.7),  # top-k tie straddling k, then top-p
    ([2.0, 1.0, 1.0, 0.0, -3.0], 1.0, 2, 0.5),  # ... where top-p keeps the top token alone
    ([0.5, 0.5, 0.5, 0.5, 0.5], 1.3, 2, 0.3),  # all tied: nothing can be cut
    ([3.0, 3.0, 1.0, 0.0, 0.0], 0.0, 1, 0.5),  # temperature 0: the first argmax
    ([1.7, -0.4, 0.9, 2.2, 0.1], 2.0, 3, 0.9),  # all three, no ties
    ([1.7, -0.4, 0.9, 2.2, 0.1], 0.5, 4, 0.6),
]


def test_probs_equal_an_independent_numpy_reference():
  rng = np.random.default_rng(7)
  cases = PROB_CASES + [(list(rng.normal(0, 2, 7)), float(rng.uniform(0.3, 2)),
                         int(rng.integers(0, 8)), float(rng.uniform(0.2, 1)))
                        for _ in range(40)]
  for lg, t, k, p in cases:
    sp = sampling.Params(np.float32(t), np.int32(k), np.float32(p))
    got = np.asarray(sampling.probs(np.float32([lg]), sp))[0]
    np.testing.assert_allclose(got, reference_probs(lg, t, k, p), atol=1e-6,
                               err_msg=str((lg, t, k, p)))


# Greedy: temperature 0 (either program) equals a no-cache reference, ragged prompts, every kind.
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
    (dict(temperature=-0.1), "--temperature"), (dict(temperature=float("nan")), "--temperature"),
    (dict(temperature=float("inf")), "--temperature"), (dict(top_p=0.0), "--top_p"),
    (dict(top_p=1.5), "--top_p"), (dict(top_k=-1), "--top_k"), (dict(seed=-1), "--seed"),
])
def test_bad_sampling_arguments(kw, flag):
  m, params = make("projection")
  with pytest.raises(ValueError, match=f"^{flag}: "):
    decode_lib.decode(params, m.args, [[1]], k=2, max_new_tokens=2, eos_id=-1, pad_id=PAD, **kw)
  with pytest.raises(ValueError, match="^--num_samples: "):
    decode_lib.repeat([[1]], 0)


# The generate CLI: sampling flags end to end, and bad input as one line, exit 2, nothing printed.

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  from mtp_jax import convert  # pylint: disable=import-outside-toplevel
  c = tiny_config("sequential", n_future=3)
  c.model.vocab_size = 259  # the byte tokenizer
  _, params = tiny_model(c)
  wd = str(tmp_path_factory.mktemp("gen") / "wd")
  convert.write_workdir(wd, c, params)
  return wd


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
  from mtp_jax import generate  # pylint: disable=import-outside-toplevel
  generate.FLAGS.unparse_flags()
  generate.FLAGS(["generate", "--workdir", workdir, "--prompt", "x", *args])
  with pytest.raises(SystemExit) as e:
    generate.main([])
  cap = capsys.readouterr()
  assert e.value.code == 2 and cap.out == ""
  assert len(cap.err.strip().splitlines()) == 1 and cap.err.startswith(f"error: {flag}: "), cap.err


def full_sort_probs(logits_xV, sp: sampling.Params):
  """The truncation by one full sort of the vocabulary (what `sampling.probs` computed before
  its top-k prefilter): the reference the prefilter must agree with."""
  V = logits_xV.shape[-1]
  z = logits_xV.astype(jnp.float32) / sp.temperature
  desc = -jnp.sort(-z, axis=-1)
  n = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, V), V)
  in_k = jnp.arange(V) < n
  sp_ = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
  keep = in_k & ((jnp.cumsum(sp_, axis=-1) - sp_ < sp.top_p) | (sp.top_p >= 1))
  thr = jnp.take_along_axis(desc, (jnp.maximum(keep.sum(-1), 1) - 1)[..., None], axis=-1)
  return jax.nn.softmax(jnp.where(z >= thr, z, -jnp.inf), axis=-1)


@pytest.mark.parametrize("scale, top_k, top_p", [
    (4.0, 0, 0.9),  # peaked: the nucleus lies within the prefilter
    (0.1, 0, 0.9),  # flat: the nucleus is wider than the prefilter, the full sort decides
    (1.0, 10, 0.8), (1.0, 100, 0.95),  # top-k inside / beyond the prefilter
    (1.0, 50, 1.0), (1.0, 0, 1.0)])
def test_prefiltered_truncation_equals_the_full_sort(scale, top_k, top_p):
  rng = np.random.default_rng(0)
  logits_xV = jnp.asarray(scale * rng.standard_normal((2, 5, 300)), jnp.float32)
  sp = sampling.Params(jnp.float32(0.9), jnp.int32(top_k), jnp.float32(top_p))
  got = np.asarray(jax.jit(sampling.probs)(logits_xV, sp))
  want = np.asarray(full_sort_probs(logits_xV, sp))
  np.testing.assert_array_equal(got > 0, want > 0)  # the same kept set
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  if scale == 0.1:
    assert ((want > 0).sum(-1) > sampling.PREFILTER).all()  # the fall-back was needed
