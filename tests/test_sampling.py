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


@pytest.fixture(scope="module", params=KINDS)
def model(request):
  c = tiny_config(request.param, n_future=K)
  c.model.vocab_size = V
  m, params = tiny_model(c, seed=3)
  # Sharper than a random init's near-uniform heads, so p and q differ and the test has power.
  params = jax.tree.map(lambda x: x * 1.3 if x.ndim == 2 else x, params)
  return m, params


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


def test_plain_sampling_is_exact_in_distribution(model):
  m, params = model
  if m.args.head_kind != "parallel":
    pytest.skip("head 1 alone: one kind is enough")
  sp = SETTINGS[1]
  r = sample_rows(m, params, k=1, seed=5, **sp)
  assert chi2_pvalue(r.tokens, exact_distribution(m, params, sampling.Params(**sp))) > 1e-3


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


@pytest.mark.parametrize("wrong", [always_accept, resample_from_p])
def test_chi_square_rejects_a_wrong_rule(model, monkeypatch, wrong):
  """The test above has power: the same statistic at the same sample size rejects wrong rules."""
  m, params = model
  if m.args.head_kind != "parallel":
    pytest.skip("one kind shows the power")
  monkeypatch.setattr(sampling, "accept_sampled", wrong)
  sp = SETTINGS[0]
  # One row more than above: a new shape, so the loop is traced again with the wrong rule.
  r = sample_rows(m, params, k=K, n=N + 1, **sp)
  assert chi2_pvalue(r.tokens, exact_distribution(m, params, sampling.Params(**sp))) < 1e-6
