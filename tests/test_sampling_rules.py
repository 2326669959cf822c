"""The sampling rules by hand and against independent references (no model): the speculative
acceptance rule on hand-worked cases, draws and truncation by hand, `sampling.probs` against a
NumPy reference of temperature -> top-k -> top-p (ties included), the top-k prefilter against
a full sort of the vocabulary, and the tree's multi-draft rule (`sampling.accept_tree`) against
the chain's rule and SpecInfer's written out in NumPy: exact for the drafts it is for, and not
for the wrong ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from mtp_jax.decoding import sampling

# accept_sampled by hand. V = 3, k = 3: drafts d1, d2 drawn from q1, q2; head 1's p at slots 0..2.
P3 = [[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]]
Q2 = [[0.25, 0.75, 0.0], [0.5, 0.5, 0.0]]
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
      sampling.cycle_tokens(np.asarray([[5, 6], [5, 6], [5, 6]], np.int32), np.asarray([0, 1, 2]),
                      np.asarray([9, 9, 9])), [[9, 9, 9], [5, 9, 9], [5, 6, 9]])


@pytest.mark.slow
def test_draw_and_truncation_by_hand():
  p = np.float32([[0.1, 0.0, 0.6, 0.3]])
  # cumulative 0.1, 0.1, 0.7, 1.0: u picks the first token whose cumulative mass exceeds u.
  got = [int(sampling.draw(p, np.float32([u]))[0]) for u in (0.0, 0.099, 0.101, 0.69, 0.71, 0.9999)]
  assert got == [0, 0, 2, 2, 3, 3]  # token 1, of mass 0, never
  lg = np.log(np.float32([[0.5, 0.2, 0.15, 0.1, 0.05]]))
  sp = lambda t, k, p: sampling.Settings(np.float32(t), np.int32(k), np.float32(p))
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


@pytest.mark.slow
def test_probs_equal_an_independent_numpy_reference():
  rng = np.random.default_rng(7)
  cases = PROB_CASES + [(list(rng.normal(0, 2, 7)), float(rng.uniform(0.3, 2)),
                         int(rng.integers(0, 8)), float(rng.uniform(0.2, 1)))
                        for _ in range(40)]
  for lg, t, k, p in cases:
    sp = sampling.Settings(np.float32(t), np.int32(k), np.float32(p))
    got = np.asarray(sampling.probs(np.float32([lg]), sp))[0]
    np.testing.assert_allclose(got, reference_probs(lg, t, k, p), atol=1e-6,
                               err_msg=str((lg, t, k, p)))


# Greedy: temperature 0 (either program) equals a no-cache reference, ragged prompts, every kind.


def full_sort_probs(logits_xV, sp: sampling.Settings):
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
@pytest.mark.slow
def test_prefiltered_truncation_equals_the_full_sort(scale, top_k, top_p):
  rng = np.random.default_rng(0)
  logits_xV = jnp.asarray(scale * rng.standard_normal((2, 5, 300)), jnp.float32)
  sp = sampling.Settings(jnp.float32(0.9), jnp.int32(top_k), jnp.float32(top_p))
  got = np.asarray(jax.jit(sampling.probs)(logits_xV, sp))
  want = np.asarray(full_sort_probs(logits_xV, sp))
  np.testing.assert_array_equal(got > 0, want > 0)  # the same kept set
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  if scale == 0.1:
    assert ((want > 0).sum(-1) > sampling.PREFILTER).all()  # the fall-back was needed


def test_exact_threshold_equals_the_sorted_one():
  """The bisection that replaces the full sort (a flat draft head's nucleus is wider than the
  prefilter): the same smallest kept value as the NumPy reference, over top-k, top-p and both,
  with ties on the edges, negative and positive values, -inf, and SmolLM2's 49,152 tokens."""
  rng = np.random.default_rng(5)
  rows = [rng.standard_normal(300) * s for s in (0.01, 0.1, 1.0, 5.0)]
  tied = np.round(rng.standard_normal(300) * 2) / 2  # few distinct values: ties everywhere
  rows += [tied, tied - 10.0, np.where(rng.random(300) < 0.3, -np.inf, tied)]
  z_xV = np.float32(rows)
  for top_k, top_p in [(0, 0.9), (0, 0.3), (100, 1.0), (7, 1.0), (100, 0.8), (300, 0.99),
                       (1, 0.5), (0, 0.999)]:
    sp = sampling.Settings(jnp.float32(1.0), jnp.int32(top_k), jnp.float32(top_p))
    got = np.asarray(jax.jit(sampling.exact_threshold)(jnp.asarray(z_xV), sp))[:, 0]
    want = np.stack([reference_probs(z, 1.0, top_k, top_p) for z in z_xV])
    want_thr = np.where(want > 0, z_xV, np.inf).min(-1)
    np.testing.assert_array_equal(got, want_thr, err_msg=str((top_k, top_p)))
  flat = jnp.asarray(rng.standard_normal((2, 49152)) * 0.3, jnp.float32)
  sp = sampling.Settings(jnp.float32(1.0), jnp.int32(0), jnp.float32(0.95))
  got = np.asarray(jax.jit(sampling.probs)(flat, sp))
  want = np.asarray(full_sort_probs(flat, sp))
  assert ((want > 0).sum(-1) > 10_000).all()  # far past the prefilter
  np.testing.assert_array_equal(got > 0, want > 0)


@pytest.mark.parametrize("top_k, top_p", [(10, 1.0), (10, 0.5), (sampling.PREFILTER, 0.9),
                                          (0, 0.3)])
def test_prefilter_keeps_ties_like_the_reference(top_k, top_p):
  """Ties straddling the k-th value (and the prefilter's edge): the prefiltered truncation keeps
  the same set, with the same masses, as the NumPy reference."""
  rng = np.random.default_rng(1)
  logits_V = rng.standard_normal(300).astype(np.float32) - 3.0
  logits_V[5:80] = 1.0  # 75 tied tokens: across top_k = 10 and across the 64-token prefilter
  logits_V[:5] = [4.0, 3.5, 3.0, 2.5, 2.0]
  sp = sampling.Settings(jnp.float32(1.0), jnp.int32(top_k), jnp.float32(top_p))
  got = np.asarray(jax.jit(sampling.probs)(jnp.asarray(logits_V), sp))
  want = reference_probs(logits_V, 1.0, top_k, top_p)
  np.testing.assert_array_equal(got > 0, want > 0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


# accept_tree: a chain is accept_sampled with one-hot q; one node's siblings against SpecInfer's
# rule written out in NumPy; what the rule's outcome is distributed as, right and wrong.

def test_accept_tree_on_a_chain_is_accept_sampled_with_point_masses():
  """The chain root -> d1 -> d2 with the hand-worked cases' p and uniforms, and 200 random ones:
  the same (drafts accepted, next token) as accept_sampled given q = one-hot on each draft."""
  rng = np.random.default_rng(3)
  names, drafts, u, _ = zip(*RULE_CASES)
  drafts = np.concatenate([np.asarray(drafts), rng.integers(0, 3, (200, 2))]).astype(np.int32)
  u = np.concatenate([np.asarray(u), rng.random((200, 3))]).astype(np.float32)
  B = len(drafts)
  p = np.broadcast_to(np.float32(P3), (B, 3, 3))
  m, nxt = sampling.accept_sampled(drafts, p, np.eye(3, dtype=np.float32)[drafts], u)
  tokens = np.concatenate([np.zeros((B, 1), np.int32), drafts], axis=1)
  children = np.broadcast_to(np.int32([[1], [2], [-1]]), (B, 3, 1))
  best, nxt_t = sampling.accept_tree(tokens, p, children, u)
  np.testing.assert_array_equal(best, m)
  np.testing.assert_array_equal(nxt_t, nxt)


def specinfer_node(p, xs, qs, us, u_draw):
  """SpecInfer's rule at one node, from the paper (NumPy, float64): child x (drafted from q) is
  accepted with probability min(1, r(x) / q(x)), r the normalised residual; on its rejection
  r <- normalise(max(0, r - q)); with every child rejected, a draw from r. Returns the token."""
  r = np.asarray(p, np.float64) / np.sum(p)
  for x, q, u in zip(xs, qs, us):
    if u * q[x] < r[x]:
      return x
    r = np.maximum(r - q, 0.0)
    r /= r.sum()
  return int(np.searchsorted(np.cumsum(r), u_draw * r.sum(), side="right"))


V6 = 6
P6 = np.asarray([0.3, 0.05, 0.25, 0.15, 0.2, 0.05])  # head 1's p at the node
Q6 = np.asarray([0.1, 0.4, 0.3, 0.05, 0.1, 0.05])  # the drafting head's q (ranks: 1, 2, 0 or 4)
S6 = 40000  # outcomes per rule


def node_outcomes(rule, n=S6, seed=0):
  """n tokens after one node (3 children) under `rule`: "tree" = accept_tree on the top-3 of q
  (point masses), else a SpecInfer variant: "iid" children drawn i.i.d. from q, "topk" the top-3
  of q tested with q itself."""
  rng = np.random.default_rng(seed)
  u = rng.random((n, 4))
  top = np.argsort(-Q6, kind="stable")[:3]
  if rule.startswith("tree"):
    tokens = np.broadcast_to(np.int32([0, *top]), (n, 4))
    p = np.broadcast_to(np.float32(P6), (n, 4, V6))
    children = np.broadcast_to(np.int32([[1, 2, 3]] + [[-1] * 3] * 3), (n, 4, 3))
    best, nxt = sampling.accept_tree(tokens, p, children, np.float32(u),
                                     _wrong=rule.partition(":")[2] or None)
    return np.where(np.asarray(best) > 0, tokens[0][np.asarray(best)], np.asarray(nxt))
  xs = rng.choice(V6, size=(n, 3), p=Q6) if rule == "iid" else np.broadcast_to(top, (n, 3))
  return np.asarray([specinfer_node(P6, x, [Q6] * 3, ui[:3], ui[3]) for x, ui in zip(xs, u)])


def pvalue(tokens) -> float:
  return float(stats.chisquare(np.bincount(tokens, minlength=V6), P6 * len(tokens)).pvalue)


def test_accept_tree_equals_specinfer_with_point_masses():
  """Point-mass q (the tree's top-ranked drafts): accept_tree and the NumPy rule pick the same
  token from the same uniforms."""
  rng = np.random.default_rng(1)
  u = rng.random((500, 4))
  top = np.argsort(-Q6, kind="stable")[:3]
  want = [specinfer_node(P6, top, np.eye(V6)[top], ui[:3], ui[3]) for ui in u]
  got = node_outcomes("tree", n=500, seed=1)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rule, exact", [
    ("tree", True), ("iid", True),  # each rule with the drafts it is for
    ("topk", False),  # SpecInfer's q-ratio rule applied to top-ranked (not drawn) drafts
    ("tree:parent", False), ("tree:p", False)])  # the tree rule's two wrong forms
def test_node_outcome_is_distributed_as_p(rule, exact):
  """The token after one node is distributed as p exactly when the rule matches how the
  siblings were drafted; 40,000 outcomes, chi-square over the 6 tokens."""
  pval = pvalue(node_outcomes(rule))
  assert (pval > 1e-3) if exact else (pval < 1e-6), (rule, pval)
