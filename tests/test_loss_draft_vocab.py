"""The loss over a draft vocabulary (`mtp_sums(draft_ids=...)`: heads 2..n over V' ids, as
EAGLE-3 and FR-Spec draft) against a reference written out head by head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.loss import mtp_sums, summarise, targets_and_mask
from test_loss import _random_case


@pytest.mark.parametrize("objective", ["ce", "kl_to_head1"])
def test_draft_vocabulary_against_a_reference(objective):
  """heads 2..n over a draft vocabulary V' (draft_ids): per head, the NLL / KL over V' columns
  (teacher: head 1's logits over V', renormalised) of the targets inside V', against numpy;
  head 1 on the whole vocabulary as before; argmax mapped back to ids; gradients equal those of
  the same reference in jax, tiled (4 chunks) and frozen head 1 alike."""
  n, vocab = 3, 50
  h, w, tokens, segments = _random_case(n)
  tokens = tokens % vocab
  ids = np.asarray(sorted(np.random.default_rng(3).choice(vocab, 20, replace=False)), np.int32)
  assert 0.2 < np.isin(tokens, ids).mean() < 0.6  # targets both in and out of V'
  weights = np.asarray([1.0, 0.7, 0.4], np.float32)

  def reference(h, w):  # the loss written out head by head, every logit at once
    tgt, mask = targets_and_mask(tokens, segments, n)
    lg1 = jnp.einsum("bsd,dv->bsv", h[0], w[:, :vocab])
    head1 = weights[0] * jnp.sum(-jnp.take_along_axis(jax.nn.log_softmax(lg1), tgt[0][..., None],
                                                      -1)[..., 0] * mask[0]) / mask[0].sum()
    total = 0.0
    place = np.full(vocab, -1)
    place[ids] = np.arange(len(ids))
    for k in range(1, n):
      lg = jnp.einsum("bsd,dv->bsv", h[k], w[:, ids])
      inside = mask[k] & (place[np.asarray(tgt[k])] >= 0)
      if objective == "ce":
        per = -jnp.take_along_axis(jax.nn.log_softmax(lg), jnp.maximum(
            place[np.asarray(tgt[k])], 0)[..., None], -1)[..., 0]
      else:
        t = jnp.roll(jax.lax.stop_gradient(jnp.einsum("bsd,dv->bsv", h[0], w[:, ids])), -k, 1)
        p = jax.nn.softmax(t)
        per = jnp.sum(p * (jax.nn.log_softmax(t) - jax.nn.log_softmax(lg)), -1)
      total += weights[k] * jnp.sum(per * inside) / mask[k].sum()
    return head1 + total, head1

  def scanned(h, w, chunks, frozen):
    sums = mtp_sums(h, w, tokens, segments, token_chunks=chunks, vocab_size=vocab,
                    frozen_heads=frozen, objective=objective, draft_ids=ids)
    return summarise(sums, weights, 0.0)

  (ref, head1), (gh_ref, gw_ref) = jax.value_and_grad(reference, argnums=(0, 1),
                                                      has_aux=True)(h, w)
  for chunks, frozen in ((1, 0), (4, 0), (1, 1)):
    (loss, m), (gh, gw) = jax.value_and_grad(
        lambda h, w, c=chunks, f=frozen: scanned(h, w, c, f), argnums=(0, 1), has_aux=True)(h, w)
    if frozen:  # head 1's training sums are over V' too: compare heads 2..n's terms
      loss, ref = loss - weights[0] * m["head_loss"][0], ref - head1
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    np.testing.assert_allclose(gh[frozen:], gh_ref[frozen:], rtol=1e-4, atol=1e-6)
    if not frozen:
      np.testing.assert_allclose(gw, gw_ref, rtol=1e-4, atol=1e-6)
  # accuracy of heads 2..n counts their argmax over V', as ids, against every target
  full = summarise(mtp_sums(h, w, tokens, segments, vocab_size=vocab), weights, 0.0)[1]
  tgt, mask = targets_and_mask(tokens, segments, n)
  pred = ids[np.argmax(np.einsum("bsd,dv->bsv", h[1], np.asarray(w)[:, ids]), -1)]
  np.testing.assert_allclose(m["head_acc"][1], np.sum((pred == tgt[1]) & mask[1]) / mask[1].sum(),
                             rtol=1e-6)
  m = summarise(mtp_sums(h, w, tokens, segments, vocab_size=vocab, objective=objective,
                         draft_ids=ids), weights, 0.0)[1]  # not frozen: head 1 as without V'
  np.testing.assert_allclose(m["head_loss"][0], full["head_loss"][0], rtol=1e-6)
