"""Per-position acceptance alpha_k (mtp_jax.acceptance): the greedy chain count against a
hand-worked example, the sampled 1 - TV against numpy, the Leviathan estimate, and the measured
alphas of a decode's histogram."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import acceptance
from mtp_jax import loss as loss_lib


def test_greedy_alpha_counts_a_chain_hand_worked():
  """Head k at t passes where its argmax equals head 1's at t + k - 1, and only counts where
  heads 2..k-1 passed too. Head 1 predicts 1..6 at t = 0..5; head 2 agrees at t = 0, 1, 3, head 3
  at t = 0, 2, 3. Masks: head k scores t < 6 - k. Head 2: 3 of 4 (0.75). Head 3 over t < 3: head
  2 passed at t = 0, 1, head 3 too only at t = 0: 1 of 2 (0.5), though it agrees at 2 of 3."""
  pred = jnp.asarray([[[1, 2, 3, 4, 5, 6]], [[2, 3, 0, 5, 0, 0]], [[3, 0, 5, 6, 0, 0]]])
  tokens = jnp.arange(6)[None]
  tgt, mask = loss_lib.targets_and_mask(tokens, None, 3)
  sums = loss_lib._head_sums(jnp.zeros(3), jnp.zeros(3), pred, tgt, mask)
  np.testing.assert_array_equal(sums["chain"], [5, 3, 1])
  np.testing.assert_array_equal(sums["chain_prev"], [5, 4, 2])
  np.testing.assert_array_equal(sums["agree"], [5, 3, 2])
  m = loss_lib.summarise(sums, jnp.ones(3), 0.0)[1]
  np.testing.assert_allclose(m["head_alpha_greedy"], [1.0, 0.75, 0.5])
  np.testing.assert_allclose(m["head_agree"], [1.0, 0.75, 2 / 3])
  acc = acceptance.from_metrics(m)
  est = 1 + 0.75 + 0.75 * 0.5
  assert acc == {"alpha_greedy": [0.75, 0.5], "a_estimate_teacher_forced_greedy": est}


def _reference_sampled(h, w, tokens, seg):
  """1 - mean TV(head 1 at t + k - 1, head k at t) over head k's scored positions, in numpy."""
  logits = np.einsum("nbsd,dv->nbsv", np.asarray(h, np.float64), np.asarray(w, np.float64))
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  _, mask = loss_lib.targets_and_mask(tokens, seg, h.shape[0])
  mask = np.asarray(mask)
  out = [1.0]
  for k in range(1, h.shape[0]):
    tv = 0.5 * np.abs(np.roll(p[0], -k, axis=1) - p[k]).sum(-1)
    out.append(1 - (tv * mask[k]).sum() / mask[k].sum())
  return np.asarray(out)


@pytest.mark.parametrize("chunks,frozen,objective", [(1, 0, "ce"), (2, 1, "ce"),
                                                     (1, 0, "kl_to_head1"), (2, 0, "tv")])
def test_sampled_alpha_is_one_minus_tv_and_carries_no_gradient(chunks, frozen, objective):
  rng = np.random.default_rng(0)
  N, B, S, D, V = 3, 2, 8, 5, 11
  h = jnp.asarray(rng.standard_normal((N, B, S, D)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((D, V)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, V, (B, S)))
  seg = jnp.asarray([[1] * 5 + [2] * 3, [1] * 8])
  kw = dict(token_chunks=chunks, frozen_heads=frozen, objective=objective)
  sums = loss_lib.mtp_sums(h, w, tokens, seg, accept=True, **kw)
  m = loss_lib.summarise(sums, jnp.ones(N), 0.0)[1]
  want = _reference_sampled(h, w, tokens, seg)
  np.testing.assert_allclose(m["head_alpha_sampled"], want, rtol=1e-5)
  naive = loss_lib.summarise(loss_lib.naive_mtp_sums(h, w, tokens, seg, accept=True,
                                                     objective=objective), jnp.ones(N), 0.0)[1]
  np.testing.assert_allclose(naive["head_alpha_sampled"], want, rtol=1e-5)
  if objective == "tv":  # the tv objective's sums are the same total variation
    np.testing.assert_allclose(sums["objective"][1:], sums["tv"][1:], rtol=1e-6)

  def loss(h, accept):
    s = loss_lib.mtp_sums(h, w, tokens, seg, accept=accept, **kw)
    return loss_lib.weighted_loss(s, jnp.ones(N), 0.0)
  np.testing.assert_array_equal(jax.grad(loss)(h, True), jax.grad(loss)(h, False))


def test_leviathan_estimate_and_measured_alphas():
  assert acceptance.leviathan_a([]) == 1.0
  assert acceptance.leviathan_a([0.5, 0.5]) == 1.75
  assert acceptance.leviathan_a([1.0, 1.0, 1.0]) == 4.0  # every draft passes: k tokens a cycle
  # 4 cycles: 2 accepted no draft, 1 one, 1 two: P(>= 1) = 1/2, P(>= 2 | >= 1) = 1/2
  assert acceptance.from_hist([2, 1, 1]) == [0.5, 0.5]
  assert acceptance.from_hist([3, 0, 0]) == [0.0, 0.0]  # never reached: 0, not NaN
  np.testing.assert_allclose(acceptance.conditional([0.5, 0.25]), [0.5, 0.5])
  # the estimate from a histogram's own alphas is its mean tokens per cycle, m + 1 for m drafts
  hist = np.asarray([5, 3, 2, 6])
  mean = (hist * np.arange(1, 5)).sum() / hist.sum()
  assert acceptance.leviathan_a(acceptance.from_hist(hist)) == pytest.approx(mean, abs=1e-3)
  flat = {"eval/head2_alpha_greedy": 0.5, "eval/head3_alpha_greedy": 0.25, "step": 3}
  assert acceptance.from_summary(flat) == {"alpha_greedy": [0.5, 0.25],
                                           "a_estimate_teacher_forced_greedy": 1.625}


def test_the_estimate_read_under_its_old_name_too():
  """Records written before the rename carry the estimate as a_bound_<mode>: read either."""
  old = {"eval/a_bound_greedy": 1.8, "a_bound_sampled": 1.9}
  assert acceptance.estimate(old, "greedy", "eval/") == 1.8
  assert acceptance.estimate(old, "sampled") == 1.9 and acceptance.estimate(old, "greedy") is None
  new = {"a_estimate_teacher_forced_greedy": 2.0, "a_bound_greedy": 1.0}
  assert acceptance.estimate(new, "greedy") == 2.0  # the current name first
  assert acceptance.renamed("eval/a_bound_greedy") == "eval/a_estimate_teacher_forced_greedy"
  assert acceptance.renamed("a_bound_sampled") == "a_estimate_teacher_forced_sampled"
  assert acceptance.renamed("eval/head2_alpha_greedy") == "eval/head2_alpha_greedy"
