"""Sampling for `mtp_jax.decoding.decode`: temperature, top-k and top-p (nucleus) truncation,
inverse-CDF draws from per-row uniforms, and the acceptance rule of speculative sampling (Leviathan
et al. 2023, Algorithm 1 and Theorem 1; Chen et al. 2023, Algorithm 2).

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
  <= PREFILTER, or a nucleus narrower than PREFILTER tokens, the usual case), and a full sort
  of the vocabulary only when some row's does not: the same kept set either way."""
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
    thr_x1 = jax.lax.cond(fits, lambda: thr_x1,
                          lambda: threshold(-jnp.sort(-z_xV, axis=-1), None)[0])
    return jnp.where(z_xV >= thr_x1, z_xV, -jnp.inf)

  z_xV = jax.lax.cond((sp.top_k > 0) | (sp.top_p < 1), truncate, lambda z: z, z_xV)
  return jnp.where(sp.temperature > 0, jax.nn.softmax(z_xV, axis=-1), greedy_xV)


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
  sequential depths draft while sampling (`HeadKind.decode_reads`)."""
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
