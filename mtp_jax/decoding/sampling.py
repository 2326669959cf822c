"""Sampling for `mtp_jax.decoding.decode`: temperature, top-k and top-p (nucleus) truncation,
inverse-CDF draws from per-row uniforms, the acceptance rule of speculative sampling (Leviathan
et al. 2023, Algorithm 1 and Theorem 1; Chen et al. 2023, Algorithm 2) and its multi-draft form
over a draft tree's siblings (`accept_tree`; SpecInfer, Miao et al. 2024).

Randomness is per row: row b of a batch draws from jax.random.fold_in(key(seed), b), folded again
with the position of the row's newest token, so a row's samples depend on its seed, its index in
the prompt list and its own tokens, never on the other rows of the batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Settings(NamedTuple):
  """The sampling settings, as traced scalars (one compiled program serves every value); not
  model parameters."""
  temperature: jax.Array  # 0: greedy (a one-hot distribution on the argmax)
  top_k: jax.Array  # 0: off
  top_p: jax.Array  # 1: off


def check(temperature: float, top_k: int, top_p: float, seed: int) -> None:
  """One line naming the parameter, raised where the values enter (decode, the CLIs, which name
  their flags: `cli.flag_error`)."""
  if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
          and temperature >= 0):
    raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got "
                     f"{temperature!r}")
  if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
    raise ValueError(f"top_p: must be in (0, 1] (1 = off), got {top_p!r}")
  if not (isinstance(top_k, int) and top_k >= 0):
    raise ValueError(f"top_k: must be an integer >= 0 (0 = off), got {top_k!r}")
  if not (isinstance(seed, int) and 0 <= seed < 2**31):
    raise ValueError(f"seed: must be an integer in [0, 2**31), got {seed!r}")


PREFILTER = 64  # truncation looks at the most likely tokens first (see `probs`)


def probs(logits_xV, sp: Settings) -> jax.Array:
  """The distribution sampled from: softmax(logits / temperature), then top-k, then top-p
  (nucleus: the most likely tokens whose mass before them is < top_p), renormalised; as HF
  `generate` and vLLM order them (ties with the last kept token are kept). Temperature 0:
  one-hot on the argmax (greedy). No sort when neither truncation is on; otherwise the
  PREFILTER most likely tokens (lax.top_k) decide wherever the kept set lies among them (top-k
  <= PREFILTER, or a nucleus narrower than PREFILTER tokens, the usual case), and
  `exact_threshold` (bisection, no sort) only when some row's does not: the same kept set
  either way."""
  V = logits_xV.shape[-1]
  greedy_xV = jax.nn.one_hot(jnp.argmax(logits_xV, axis=-1), V, dtype=jnp.float32)
  z_xV = logits_xV.astype(jnp.float32) / jnp.maximum(sp.temperature, 1e-30)
  C = min(PREFILTER, V)

  def threshold(desc_xW, log_norm_x):
    """The smallest kept value, from the W largest values (descending), and whether the
    nucleus may go on past them; log_norm: log of the top-k set's softmax normaliser, or None
    (the W values are the whole top-k set: a softmax over them)."""
    W = desc_xW.shape[-1]
    n_x = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, V), V)  # top-k: the first n sorted,
    kth_x1 = jnp.take_along_axis(  # and ties with the n-th, whose mass counts in the nucleus
        desc_xW, jnp.broadcast_to(jnp.minimum(n_x, W) - 1, desc_xW.shape[:-1])[..., None],
        axis=-1)
    in_k_xW = (jnp.arange(W) < n_x[..., None]) | (desc_xW >= kth_x1)
    if log_norm_x is None:
      sorted_p_xW = jax.nn.softmax(jnp.where(in_k_xW, desc_xW, -jnp.inf), axis=-1)
    else:
      sorted_p_xW = jnp.where(in_k_xW, jnp.exp(desc_xW - log_norm_x[..., None]), 0.0)
    # Nucleus on the renormalised top-k: keep while the mass before a token is < top_p.
    keep_xW = in_k_xW & ((jnp.cumsum(sorted_p_xW, axis=-1) - sorted_p_xW < sp.top_p)
                         | (sp.top_p >= 1))
    n_x = jnp.maximum(jnp.sum(keep_xW, axis=-1), 1)
    # Whether the kept set may go on past the W values: the nucleus reaches the last, or (for
    # the top-k set itself) the last is in it (ties with the k-th may lie beyond).
    more_x = keep_xW[..., -1] | (in_k_xW[..., -1] & (log_norm_x is None))
    return jnp.take_along_axis(desc_xW, (n_x - 1)[..., None], axis=-1), more_x

  def truncate(z_xV):
    top_xC = jax.lax.top_k(z_xV, C)[0]
    small_k = (sp.top_k > 0) & (sp.top_k <= C)  # the top-k set lies within the prefilter
    log_norm_x = jax.nn.logsumexp(z_xV, axis=-1)  # top_k = 0: the whole vocabulary
    thr_x1, more_x = jax.lax.cond(small_k, lambda: threshold(top_xC, None),
                                  lambda: threshold(top_xC, log_norm_x))
    fits = ((small_k | (sp.top_k == 0)) & ~jnp.any(more_x)) | (C == V)
    thr_x1 = jax.lax.cond(fits, lambda: thr_x1, lambda: exact_threshold(z_xV, sp))
    return jnp.where(z_xV >= thr_x1, z_xV, -jnp.inf)

  z_xV = jax.lax.cond((sp.top_k > 0) | (sp.top_p < 1), truncate, lambda z: z, z_xV)
  return jnp.where(sp.temperature > 0, jax.nn.softmax(z_xV, axis=-1), greedy_xV)


def _order_key(z_xV) -> jax.Array:
  """uint32 keys in the order of the float32 values (the radix sort's key: negative floats'
  bits inverted, positive floats' sign bit set)."""
  u_xV = jax.lax.bitcast_convert_type(z_xV.astype(jnp.float32), jnp.uint32)
  return jnp.where(u_xV >> 31 == 1, ~u_xV, u_xV | jnp.uint32(1 << 31))


def _largest_key(key_xV, holds) -> jax.Array:
  """[...]: the largest key t with holds(t) ([...] bool), for holds true at each row's smallest
  key and monotone (true up to some t, false above): 32 halvings of [min key, max key]."""
  def halve(_, lo_hi):
    lo, hi = lo_hi
    d = hi - lo
    mid = lo + d // 2 + d % 2  # the upper middle: lo < mid <= hi while lo < hi
    ok = holds(mid)
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  return jax.lax.fori_loop(0, 32, halve, (key_xV.min(-1), key_xV.max(-1)))[0]


def exact_threshold(z_xV, sp: Settings) -> jax.Array:
  """[..., 1]: the smallest value `probs` keeps, found without sorting the vocabulary (a sort of
  49,152 logits costs ~10 ms a row on a CPU core, and a draft head's flat distribution sends
  every row here). The top-k set's threshold is the largest value v with count(z >= v) >= k;
  the nucleus's, the largest v with mass(z >= v) >= top_p over the renormalised top-k set (a
  token is kept when the mass strictly before it is < top_p: both keep ties together). Each is
  a bisection over the values' order (`_order_key`), exact: 32 halvings of a uint32 range,
  each one pass over the vocabulary."""
  V = z_xV.shape[-1]
  key_xV = _order_key(z_xV)
  n_x = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, V), V)
  kth_x = jax.lax.cond(  # top_k 0: every token (no halving)
      sp.top_k > 0, lambda: _largest_key(key_xV, lambda t: jnp.sum(key_xV >= t[..., None], -1)
                                         >= n_x), lambda: key_xV.min(-1))
  in_k_xV = key_xV >= kth_x[..., None]
  p_xV = jax.nn.softmax(jnp.where(in_k_xV, z_xV, -jnp.inf), axis=-1)
  t_x = jax.lax.cond(  # top_p 1: the top-k set (no halving)
      sp.top_p < 1, lambda: jnp.maximum(kth_x, _largest_key(
          key_xV, lambda t: jnp.sum(jnp.where(key_xV >= t[..., None], p_xV, 0.0), -1)
          >= sp.top_p)), lambda: kth_x)
  return jnp.min(jnp.where(key_xV >= t_x[..., None], z_xV, jnp.inf), -1, keepdims=True)


def draw(p_xV, u_x) -> jax.Array:
  """Inverse-CDF draw from (unnormalised) weights with a uniform in [0, 1): the first token
  whose cumulative weight exceeds u * total. A token of weight 0 is never drawn."""
  c_xV = jnp.cumsum(p_xV, axis=-1)
  t_x1 = (u_x * c_xV[..., -1])[..., None]
  idx_x = jnp.sum(c_xV <= t_x1, axis=-1)
  # u * total can round up to total: fall back to the last token of positive weight.
  last_x = p_xV.shape[-1] - 1 - jnp.argmax(jnp.flip(p_xV > 0, axis=-1), axis=-1)
  return jnp.minimum(idx_x, last_x).astype(jnp.int32)


def picker(sp: Settings):
  """pick(logits_xV, u_x) -> [x] tokens: a draw from `probs(logits, sp)` with the uniform u, how
  sequential depths draft while sampling (`heads.Drafting.pick`)."""
  return lambda logits_xV, u_x: draw(probs(logits_xV, sp), u_x)


def row_keys(seed, batch: int) -> jax.Array:
  """One key per row: fold_in(key(seed), row index)."""
  base = jax.random.PRNGKey(seed)
  return jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.arange(batch))


def uniforms(keys_B, pos_B, n: int) -> jax.Array:
  """[B, n] uniforms in [0, 1) for the cycle of each row whose newest token is at pos."""
  return jax.vmap(lambda key, p: jax.random.uniform(jax.random.fold_in(key, p), (n,)))(
      keys_B, pos_B)


def accept_sampled(drafts_BxK1, p_BxKxV, q_BxK1xV, u_BxK):
  """One cycle of speculative sampling (Leviathan et al. 2023, Algorithm 1): returns
  (m_B drafts accepted, next_B the token after them).

  Draft d_j (drafts[:, j - 1], j = 1..K-1) was drawn from q_j = q[:, j - 1]; head 1's p at window
  slot j - 1 is the distribution of the same position. d_j is accepted with probability
  min(1, p(d_j) / q_j(d_j)) (u_j * q < p), while every draft before it was. At the first
  rejection (slot m) the next token is drawn from normalise(max(0, p_m - q_{m+1})); if every
  draft passes, from p at the last slot (the bonus token). u[:, :K-1] decide acceptance,
  u[:, K-1] draws the next token. The tokens gained are d_1..d_m, next: distributed exactly as
  m + 1 draws from p (Theorem 1), whatever q is."""
  B, K, _ = p_BxKxV.shape
  rows_B = jnp.arange(B)
  pd_BxK1 = jnp.take_along_axis(p_BxKxV[:, :K - 1], drafts_BxK1[..., None], axis=-1)[..., 0]
  qd_BxK1 = jnp.take_along_axis(q_BxK1xV, drafts_BxK1[..., None], axis=-1)[..., 0]
  ok_BxK1 = (u_BxK[:, :K - 1] * qd_BxK1 < pd_BxK1).astype(jnp.int32)
  m_B = jnp.sum(jnp.cumprod(ok_BxK1, axis=1), axis=1)
  p_BxV = p_BxKxV[rows_B, m_B]
  if K > 1:
    q_BxV = jnp.where((m_B < K - 1)[:, None], q_BxK1xV[rows_B, jnp.minimum(m_B, K - 2)], 0.0)
  else:
    q_BxV = jnp.zeros_like(p_BxV)
  r_BxV = jnp.maximum(p_BxV - q_BxV, 0.0)
  # p = q up to rounding leaves no residual mass; rejection then had probability ~0.
  r_BxV = jnp.where(jnp.sum(r_BxV, axis=-1, keepdims=True) > 0, r_BxV, p_BxV)
  return m_B, draw(r_BxV, u_BxK[:, K - 1])


def cycle_tokens(drafts_BxK1, m_B, next_B) -> jax.Array:
  """[B, K]: a sampled cycle's tokens, d_1..d_m then next (slots after m hold next again), before
  `decode_loop.gain` cuts them after an EOS and to the budget (greedy's counterpart: head 1's
  tokens)."""
  K = drafts_BxK1.shape[1] + 1
  d_BxK = jnp.concatenate([drafts_BxK1, next_B[:, None]], axis=1)
  return jnp.where(jnp.arange(K) < m_B[:, None], d_BxK, next_B[:, None]).astype(jnp.int32)


def accept_tree(tokens_BxN, p_BxNxV, children_BxNxC, u_BxU, *, _wrong: str | None = None):
  """One cycle of recursive rejection sampling over a draft tree's siblings (SpecInfer's
  multi-step speculative sampling, Miao et al. 2024, Algorithm 2; SpecTr, Sun et al. 2023):
  returns (best_B, the deepest accepted node; next_B, the token after it).

  tokens[:, n] is node n's token, p[:, n] head 1's (truncated) distribution after the path
  root..n, children[:, n] node n's children in the order they are tried (-1 past them; a
  node's children hold distinct tokens). From the root: at the current node, with residual r =
  p[:, node], each child x in turn is accepted with probability min(1, r(x) / q(x)), q being the
  distribution x was drafted from; on its rejection r <- normalise(max(0, r - q)) before the
  next sibling; the first accepted child becomes the current node, and when every child is
  rejected (or the node is a leaf) the next token is drawn from r. u[:, d C + r] tests sibling
  r at depth d + 1 (C = children.shape[2]), u[:, -1] draws the next token.

  Why it is exact, and why this form of the rule. The tree's drafts are not draws: every child
  is a head's rank-r candidate (a static tree: the top c_d; a dynamic one: the most likely
  paths), a deterministic function of what the heads saw, so the distribution it was drafted
  from is the point mass q = delta_x. The rule then reads: accept x with probability
  r(x) / sum(r), and on rejection r <- r with x zeroed. With distinct siblings x_1..x_c and p
  normalised, sibling x_i is reached with probability 1 - p(x_1) - ... - p(x_{i-1}) (the mass
  of the residual, which the rejections leave as p on the untried tokens) and accepted there with
  probability p(x_i) / that mass: accepted with probability p(x_i) in all; every sibling is
  rejected with probability 1 - sum_i p(x_i), and the draw from the residual (p off the siblings,
  renormalised) then gives each other token y probability p(y). So the token after the node is
  distributed exactly as p, the child it picks is the node whose p the next depth uses, and by
  induction over depths every token gained is a draw from head 1's p after the tokens before it:
  the cycle's output is distributed as plain sampling. (Equivalently: draw y from p and follow
  the child whose token is y; the sibling-by-sibling form is kept because, with one uniform per
  depth and sibling rank, a sub-tree's walk is a prefix of the whole tree's, which the cost model
  reads.) SpecInfer's
  rule with q the heads' own distribution, for children drawn i.i.d. from q, is exact only for
  such draws: applied to top-ranked candidates it is not (tests/test_sampling_rules.py shows
  both). A chain (one child per node) is `accept_sampled` with one-hot q.

  _wrong (tests only): "parent" tests every sibling against the parent's p, never renormalised
  after a rejection; "p" draws the token after a rejected node's children from p itself rather
  than the residual. Both are plausible bugs the chi-square tests must catch."""
  B, N, C = children_BxNxC.shape
  levels = (u_BxU.shape[1] - 1) // C
  rows_B = jnp.arange(B)

  def siblings(node_B):  # (children [B, C], their tokens, valid, p at the node [B, V])
    kids_BxC = children_BxNxC[rows_B, node_B]
    valid_BxC = kids_BxC >= 0
    x_BxC = jnp.take_along_axis(tokens_BxN, jnp.maximum(kids_BxC, 0), axis=1)
    return kids_BxC, x_BxC, valid_BxC, p_BxNxV[rows_B, node_B]

  node_B = jnp.zeros((B,), jnp.int32)
  live_B = jnp.ones((B,), bool)
  for d in range(levels):
    kids_BxC, x_BxC, valid_BxC, p_BxV = siblings(node_B)
    px_BxC = jnp.where(valid_BxC, jnp.take_along_axis(p_BxV, x_BxC, axis=1), 0.0)
    # The residual's mass when sibling r is tried: p less the siblings rejected before it.
    mass_BxC = jnp.sum(p_BxV, axis=-1, keepdims=True) - (jnp.cumsum(px_BxC, axis=1) - px_BxC)
    if _wrong == "parent":
      mass_BxC = jnp.broadcast_to(jnp.sum(p_BxV, axis=-1, keepdims=True), px_BxC.shape)
    ok_BxC = valid_BxC & (u_BxU[:, d * C:(d + 1) * C] * mass_BxC < px_BxC)
    hit_B = live_B & jnp.any(ok_BxC, axis=1)
    node_B = jnp.where(hit_B, kids_BxC[rows_B, jnp.argmax(ok_BxC, axis=1)], node_B)
    live_B = hit_B
  _, x_BxC, valid_BxC, p_BxV = siblings(node_B)  # every child of the last node was rejected
  tried_BxV = jnp.any((jnp.arange(p_BxV.shape[-1]) == x_BxC[..., None]) & valid_BxC[..., None],
                      axis=1)
  r_BxV = p_BxV if _wrong == "p" else jnp.where(tried_BxV, 0.0, p_BxV)
  # All of p on the siblings leaves no residual mass; a rejection then had probability ~0.
  r_BxV = jnp.where(jnp.sum(r_BxV, axis=-1, keepdims=True) > 0, r_BxV, p_BxV)
  return node_B, draw(r_BxV, u_BxU[:, -1])
