"""Per-head multi-token cross-entropy with O(V + d) logit memory (Gloeckle et al. 2024 §2, Fig. 2).

    L_n = sum_i lambda_i * mean_t [ -log p_i(x_{t+i} | x_{<=t}) ]

Head i's target at position t is x_{t+i}; the last i positions of every row, padding (segment id
0) and positions whose target lies in another packed document are dropped. Each head is averaged
over its own tokens, then the heads are summed with weights lambda_i (1.0 in the paper;
DeepSeek-V3: 1 for the main head and lambda / D for each of the D depths).

Memory: `lax.scan` over heads with a `jax.checkpoint` body that saves nothing, so the backward
pass recomputes one head's logits at a time: only one [B, S, V] block is alive instead of N.
`token_chunks` tiles each head along the sequence to bound it further, [B, S / C, V].
(`dots_with_no_batch_dims_saveable` would save every head's logits: measured, see docs/DESIGN.md.)
Nothing goes through Flax intermediates: the loss and metrics are returned.

Padded vocabulary (model.vocab_multiple): `vocab_size` names the real ids; the logits of the pad
columns are -inf (`model.mask_pad_logits`), so the logsumexp, the argmax and the gradients see
the real vocabulary only, in the scanned loss, its token tiles and the naive reference alike.
On one CPU device, where nothing is sharded, the scanned loss multiplies the real columns only.

Over training (`head_weights_at`): loss.mtp_lambda_schedule moves mtp_lambda, and
loss.head_curriculum switches heads 2..n on one by one, both by the train state's step.
loss.draft_objective trains heads 2..n on head 1's own distribution at the same target position
(KL or total variation, stop-gradient), its logits recomputed in the same per-head scan.

Everything is first a per-head sum over tokens (`mtp_sums`: NLL, lse^2, correct, agreeing,
scored tokens); `summarise` divides once per head. Sums add up across micro-batches, so a
gradient-accumulating train step (steps.py) reproduces the full batch's per-head token means.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mtp_jax import loss_fields
from mtp_jax import backends, layers, sharding
from mtp_jax.model import mask_pad_logits, unembedding

_SAVE_NOTHING = jax.checkpoint_policies.nothing_saveable


def head_weights(config: ml_collections.ConfigDict) -> np.ndarray:
  """lambda_i for i = 1..n_future from `config.loss`."""
  n, lo = config.model.n_future, config.loss
  scheme = loss_fields.parse_head_weights(lo.head_weights)
  if not isinstance(scheme, str):
    return np.asarray(scheme, np.float32)
  if lo.head_weights == "uniform":
    return np.ones(n, np.float32)
  if lo.head_weights == "geometric":
    return lo.geometric_decay ** np.arange(n, dtype=np.float32)
  if lo.head_weights == "deepseek":  # DeepSeek-V3 eq. 25: L_main + lambda / D * sum_k L_k
    return np.asarray([1.0] + [lo.mtp_lambda / max(n - 1, 1)] * (n - 1), np.float32)
  raise ValueError(f"config.loss.head_weights: unknown {lo.head_weights!r}")


def weights_vary(config: ml_collections.ConfigDict) -> bool:
  """Whether lambda_i changes over training (loss.mtp_lambda_schedule, loss.head_curriculum)."""
  return config.loss.mtp_lambda_schedule != "constant" or config.loss.head_curriculum > 0


def _at_fraction(fraction: float, steps: int) -> int:
  """The first step at `fraction` of `steps` (rounded first: 0.8 * 20 is 16.000000000000004)."""
  return math.ceil(round(fraction * steps, 6))


def curriculum_starts(config: ml_collections.ConfigDict) -> np.ndarray:
  """The step each head switches on at under loss.head_curriculum = f: head k at
  f * (k - 1) / (n - 1) of train.steps (head 1 at 0; every head from f on)."""
  n, f, steps = config.model.n_future, config.loss.head_curriculum, config.train.steps
  return np.asarray([_at_fraction(f * k / max(n - 1, 1), steps) for k in range(n)], np.int32)


def mtp_lambda_at(config: ml_collections.ConfigDict, step):
  """loss.mtp_lambda at train step `step` (an int or traced) under loss.mtp_lambda_schedule."""
  kind, args = loss_fields.parse_lambda_schedule(config.loss.mtp_lambda_schedule)
  steps, step = config.train.steps, jnp.asarray(step, jnp.int32)
  if kind == "constant":
    return jnp.float32(config.loss.mtp_lambda)
  if kind == "steps":
    starts = np.asarray([_at_fraction(f, steps) for _, f in args], np.int32)
    return jnp.asarray([v for v, _ in args], jnp.float32)[jnp.sum(step >= starts) - 1]
  p = jnp.clip(step.astype(jnp.float32) / steps, 0.0, 1.0)
  if kind == "cosine":
    p = (1.0 - jnp.cos(jnp.pi * p)) / 2.0
  return jnp.float32(args[0]) + jnp.float32(args[1] - args[0]) * p


def head_weights_at(config: ml_collections.ConfigDict, step):
  """lambda_i at train step `step` (an int or traced): `head_weights`, with loss.mtp_lambda
  following loss.mtp_lambda_schedule (head_weights = "deepseek": 1, then lambda / D) and, under
  loss.head_curriculum, each head 0 until its `curriculum_starts` step."""
  n, w_N = config.model.n_future, jnp.asarray(head_weights(config))
  if config.loss.mtp_lambda_schedule != "constant":
    depth = mtp_lambda_at(config, step) / max(n - 1, 1)
    w_N = jnp.concatenate([w_N[:1], jnp.broadcast_to(depth, (n - 1,))])
  if config.loss.head_curriculum > 0:
    w_N = jnp.where(jnp.asarray(step, jnp.int32) >= curriculum_starts(config), w_N, 0.0)
  return w_N


def targets_and_mask(tokens_BxS, segment_ids_BxS, n_future: int):
  """tgt_NxBxS[i, b, t] = tokens[b, t + i + 1]; mask_NxBxS says which of them count."""
  B, S = tokens_BxS.shape
  t_S = jnp.arange(S)
  tgts, masks = [], []
  for k in range(1, n_future + 1):
    tgt_BxS = jnp.pad(tokens_BxS[:, k:], ((0, 0), (0, k)))
    mask_BxS = jnp.broadcast_to(t_S < S - k, (B, S))
    if segment_ids_BxS is not None:
      seg_tgt_BxS = jnp.pad(segment_ids_BxS[:, k:], ((0, 0), (0, k)))
      mask_BxS = mask_BxS & (segment_ids_BxS != 0) & (seg_tgt_BxS == segment_ids_BxS)
    tgts.append(tgt_BxS)
    masks.append(mask_BxS)
  return jnp.stack(tgts), jnp.stack(masks)


def _logits(h_BxTxD, unembed_DxV, vocab_size, dot):
  """One tile's f32 logits, pad columns -inf."""
  B, T, D = h_BxTxD.shape  # one token axis: XLA:CPU's fast GEMM path (see layers.tokens_2d)
  logits_BxTxV = dot(h_BxTxD.reshape(B * T, D), unembed_DxV.astype(h_BxTxD.dtype),
                     (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  logits_BxTxV = logits_BxTxV.reshape(B, T, -1)
  # On a mesh, keep the tile's rows with their batch shard: unconstrained, GSPMD all-gathered
  # the whole global tile onto every chip (33.5 GB at 7B scale, found with plan_memory).
  logits_BxTxV = sharding.constrain(logits_BxTxV, ("batch", None, "vocab"))
  return mask_pad_logits(logits_BxTxV, vocab_size)


def divergence(teacher_BxTxV, logits_BxTxV, objective: str, lse_BxT=None):
  """Per token, from head 1's logits (the teacher) p and a draft head's q: KL(p || q)
  ("kl_to_head1") or the total variation (1/2) sum |p - q| ("tv"), the probability that
  speculative sampling rejects the draft. Pad columns (-inf in both) add nothing. `lse_BxT`:
  the draft's logsumexp where the caller has it."""
  logp = jax.nn.log_softmax(teacher_BxTxV, axis=-1)
  p = jnp.exp(logp)
  lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1) if lse_BxT is None else lse_BxT
  if objective == "kl_to_head1":  # sum p (log p - z) + lse(z), as sum p = 1
    return jnp.sum(jnp.where(p > 0, p * (logp - logits_BxTxV), 0.0), axis=-1) + lse_BxT
  return 0.5 * jnp.sum(jnp.abs(p - jnp.exp(logits_BxTxV - lse_BxT[..., None])), axis=-1)


class TokenStats(NamedTuple):
  """A tile's (head's, heads') token sums and argmax by name; None where not computed."""
  nll: jax.Array
  zsq: jax.Array
  pred: jax.Array
  objective: jax.Array | None = None
  tv: jax.Array | None = None


def _token_stats(h_BxTxD, unembed_DxV, tgt_BxT, mask_BxT, vocab_size, dot=jax.lax.dot_general,
                 teacher_BxTxD=None, objective="ce") -> TokenStats:
  """One tile's TokenStats; with a teacher's hidden states (stop-gradient) also the summed
  `divergence` from its distribution (a draft objective) and total variation (no gradient)."""
  logits_BxTxV = _logits(h_BxTxD, unembed_DxV, vocab_size, dot)
  lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
  tgt_logit_BxT = jnp.take_along_axis(logits_BxTxV, tgt_BxT[..., None], axis=-1)[..., 0]
  m = mask_BxT.astype(jnp.float32)
  nll = jnp.sum((lse_BxT - tgt_logit_BxT) * m)
  zsq = jnp.sum(jnp.square(lse_BxT) * m)
  out = TokenStats(nll, zsq, jnp.argmax(logits_BxTxV, axis=-1).astype(jnp.int32))
  if teacher_BxTxD is None:
    return out
  teacher_BxTxV = _logits(teacher_BxTxD, jax.lax.stop_gradient(unembed_DxV), vocab_size, dot)
  div = lambda kind: jnp.sum(divergence(teacher_BxTxV, logits_BxTxV, kind, lse_BxT) * m)
  tv = div("tv")
  obj = None if objective == "ce" else (tv if objective == "tv" else div(objective))
  return out._replace(objective=obj, tv=jax.lax.stop_gradient(tv))


def head_token_counts(tokens_BxS, segment_ids_BxS, n_future: int):
  """count_N[i]: how many targets head i + 1 is scored on. Depends on the batch alone, so a
  gradient-accumulating step can compute the full batch's counts before its micro-batches."""
  _, mask_NxBxS = targets_and_mask(tokens_BxS, segment_ids_BxS, n_future)
  return jnp.sum(mask_NxBxS, axis=(1, 2)).astype(jnp.float32)


def _head_sums(nll_N, zsq_N, pred_NxBxS, tgt_NxBxS, mask_NxBxS):
  """Per-head sums over the scored tokens: what adds up exactly across micro-batches."""
  correct_N = jnp.sum((pred_NxBxS == tgt_NxBxS) & mask_NxBxS, axis=(1, 2))
  # Draft-acceptance proxy: head k at t against head 1's greedy choice at t + k - 1 (the same
  # target position), over head k's valid positions.
  # Greedy acceptance as a chain: draft k passes only if drafts 2..k-1 passed, so alpha_k =
  # chain[k] / chain_prev[k], both counted over head k's positions.
  N = pred_NxBxS.shape[0]
  agree, chain, chain_prev = [], [], []
  passed_BxS = jnp.ones(pred_NxBxS.shape[1:], bool)
  for k in range(N):
    head1_at_BxS = jnp.pad(pred_NxBxS[0][:, k:], ((0, 0), (0, k)))
    agree_BxS = pred_NxBxS[k] == head1_at_BxS
    agree.append(jnp.sum(agree_BxS & mask_NxBxS[k]))
    chain_prev.append(jnp.sum(passed_BxS & mask_NxBxS[k]))
    passed_BxS = passed_BxS & agree_BxS
    chain.append(jnp.sum(passed_BxS & mask_NxBxS[k]))
  f32 = lambda xs: jnp.stack(xs).astype(jnp.float32)
  return {"nll": nll_N, "zsq": zsq_N, "correct": correct_N.astype(jnp.float32),
          "agree": f32(agree), "chain": f32(chain), "chain_prev": f32(chain_prev),
          "tokens": jnp.sum(mask_NxBxS, axis=(1, 2)).astype(jnp.float32)}


def weighted_loss(sums, weights_N, z_loss: float, count_N=None):
  """sum_i lambda_i * (L_i + z * lse_i^2) / count_i, L_i the summed NLL (or, for heads 2..n
  under loss.draft_objective, the summed divergence: sums["objective"]). `count_N` defaults to
  the sums' own token counts; a micro-batch passes the whole batch's, so its losses add up to
  the batch's loss."""
  denom_N = jnp.maximum(sums["tokens"] if count_N is None else count_N, 1.0)
  per_head_N = sums.get("objective", sums["nll"]) / denom_N + z_loss * sums["zsq"] / denom_N
  return jnp.sum(jnp.asarray(weights_N) * per_head_N)


def summarise(sums, weights_N, z_loss: float):
  """Scalar loss and per-head metrics (means over each head's own tokens) from per-head sums."""
  denom_N = jnp.maximum(sums["tokens"], 1.0)
  metrics = {
      "loss": weighted_loss(sums, weights_N, z_loss),
      "head_loss": sums["nll"] / denom_N,
      "head_acc": sums["correct"] / denom_N,
      "head_agree": sums["agree"] / denom_N,
      # P(draft k passes | drafts < k passed), greedy, teacher-forced (acceptance.py)
      "head_alpha_greedy": sums["chain"] / jnp.maximum(sums["chain_prev"], 1.0),
      "head_tokens": sums["tokens"],
  }
  if "objective" in sums:  # what each head is trained on: head 1's NLL, the drafts' divergence
    metrics["head_objective"] = sums["objective"] / denom_N
  if "tv" in sums:  # speculative sampling's acceptance, sum_x min(p, q) = 1 - TV(p, q)
    metrics["head_alpha_sampled"] = 1.0 - sums["tv"] / denom_N
  return metrics["loss"], metrics


def mtp_loss(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS, weights_N, *,
             token_chunks: int = 1, z_loss: float = 0.0, vocab_size: int | None = None,
             objective: str = "ce"):
  """Memory-lean MTP loss. Returns (scalar loss, metrics with per-head [N] arrays). Columns of
  unembed_DxV from `vocab_size` on are padding (None: every column is a real id)."""
  sums = mtp_sums(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS, token_chunks=token_chunks,
                  vocab_size=vocab_size, objective=objective)
  return summarise(sums, weights_N, z_loss)


def mtp_sums(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS, *, token_chunks: int = 1,
             vocab_size: int | None = None, frozen_heads: int = 0, dot=jax.lax.dot_general,
             objective: str = "ce", accept: bool = False, draft_ids=None):
  """Per-head sums (nll, zsq, correct, agree, tokens; each [N]) of the memory-lean loss. The
  first `frozen_heads` heads get no gradient (optim.trainable = "heads": head 1 depends on
  frozen params only), so their logits are never differentiated. `dot`: the logits' product
  (layers.dot_general: XLA's, or MKL's on one CPU device).

  `objective` (loss.draft_objective) other than "ce" adds sums["objective"]: head 1's NLL, and
  for head i >= 2 the summed `divergence` from head 1's distribution at position t + i - 1 (the
  same target position, x_{t+i}) to head i's at t. Head 1's hidden states go in stop-gradient
  and its teacher logits are recomputed inside head i's scan step, next to head i's own, so
  logit memory stays O(V + d) in n. With a teacher (a draft objective, or `accept`: eval steps)
  sums["tv"] is head i's summed total variation from it (head 1: 0), the rejection rate of
  speculative sampling, from which summarise gives head_alpha_sampled.

  `draft_ids` (int [V'], real ids): a draft vocabulary for training heads 2..n (EAGLE-3's, FR-Spec's
  V' most frequent tokens): their logits, targets and teacher (head 1's distribution renormalised
  over V') span those columns alone, V / V' times cheaper; a target outside V' adds nothing to
  their nll / objective sums (their argmax, mapped back to ids, still counts in correct / agree /
  chain against every target). Head 1 keeps the whole vocabulary, except when frozen
  (`frozen_heads`, heads-only training): then its sums too are over V' (figures of a training
  step only: its loss is a constant there, and its whole-vocabulary logits would cost more than
  every draft head's). Decoding is unchanged: heads 2..n draft over the whole vocabulary
  (experiments/smollm2_heads.py measures acceptance over the whole vocabulary)."""
  N, B, S, D = h_NxBxSxD.shape
  V = unembed_DxV.shape[1] if vocab_size is None else vocab_size
  if V < unembed_DxV.shape[1] and backends.current().real_vocab_only():
    # The pad columns (model.vocab_multiple) would only be multiplied and masked where nothing
    # shards. Same maths: pad logits are -inf, their gradient 0.
    unembed_DxV = unembed_DxV[:, :V]
  C = token_chunks
  if S % C:
    raise ValueError(f"config.loss.token_chunks: must divide the sequence length {S}, got {C}")
  tgt_NxBxS, mask_NxBxS = targets_and_mask(tokens_BxS, segment_ids_BxS, N)
  draft = (objective != "ce" or accept) and N > 1
  if draft:  # head i's teacher at t: head 1 at t + i - 1 (past the end: zeros, masked)
    h1_BxSxD = jnp.pad(jax.lax.stop_gradient(h_NxBxSxD[0]), ((0, 0), (0, N), (0, 0)))

  def head(_, xs, *, W_DxV, Vn):  # W_DxV: V columns, or V' (draft_ids); scan passes both
    def stats(h_BxTxD, tgt_BxT, mask_BxT, *teacher_BxTxD):
      return _token_stats(h_BxTxD, W_DxV, tgt_BxT, mask_BxT, Vn, dot, *teacher_BxTxD,
                          objective=objective)

    h_BxSxD, tgt_BxS, mask_BxS, *shift = xs
    teacher = [jax.lax.dynamic_slice_in_dim(h1_BxSxD, shift[0], S, axis=1)] if shift else []
    if C == 1:
      return None, stats(h_BxSxD, tgt_BxS, mask_BxS, *teacher)
    split = lambda a: jnp.moveaxis(a.reshape(B, C, S // C, *a.shape[2:]), 1, 0)
    _, tiles_C = jax.lax.scan(
        jax.checkpoint(lambda _, t: (None, stats(*t)), policy=_SAVE_NOTHING), None,
        tuple(split(a) for a in (h_BxSxD, tgt_BxS, mask_BxS, *teacher)))
    summed = jax.tree.map(lambda a: a.sum(0), tiles_C._replace(pred=None))
    return None, summed._replace(pred=jnp.moveaxis(tiles_C.pred, 0, 1).reshape(B, S))

  def scan(*xs, W_DxV=unembed_DxV, Vn=V):
    body = jax.checkpoint(functools.partial(head, W_DxV=W_DxV, Vn=Vn), policy=_SAVE_NOTHING)
    return jax.lax.scan(body, None, xs)[1]

  if draft_ids is not None:  # V' columns, and each id's place among them (-1: not a draft id)
    draft_ids = jnp.asarray(draft_ids, jnp.int32)
    place_V = jnp.full((V,), -1, jnp.int32).at[draft_ids].set(
        jnp.arange(len(draft_ids), dtype=jnp.int32))

  # Runs of heads scanned alike: the first F heads forward only (no backward pass through their
  # logits); with a teacher head 1 (none: its objective is its NLL, its tv 0) apart from 2..n.
  F = min(frozen_heads, N)
  cuts = sorted({0, F, N} | ({1} if draft or draft_ids is not None else set()))
  parts = []
  for lo, hi in zip(cuts, cuts[1:]):
    part = lambda a, lo=lo, hi=hi: a if (lo, hi) == (0, N) else a[lo:hi]
    h = jax.lax.stop_gradient(part(h_NxBxSxD)) if hi <= F else part(h_NxBxSxD)
    teacher = (jnp.arange(lo, hi),) if draft and lo else ()
    if draft_ids is not None and (lo or F):
      place = place_V[part(tgt_NxBxS)]
      out = scan(h, jnp.maximum(place, 0), part(mask_NxBxS) & (place >= 0), *teacher,
                 W_DxV=unembed_DxV[:, draft_ids], Vn=len(draft_ids))
      out = out._replace(pred=draft_ids[out.pred])  # argmax back to ids
    else:
      out = scan(h, part(tgt_NxBxS), part(mask_NxBxS), *teacher)
    if draft and not lo:  # head 1, no teacher: its objective is its NLL, its tv 0
      out = out._replace(objective=out.nll if objective != "ce" else None,
                         tv=jnp.zeros_like(out.nll))
    parts.append(out)
  out = parts[0] if len(parts) == 1 else jax.tree.map(lambda *x: jnp.concatenate(x), *parts)
  sums = _head_sums(out.nll, out.zsq, out.pred, tgt_NxBxS, mask_NxBxS)
  if not draft:
    return sums
  return dict(sums, tv=out.tv, **({"objective": out.objective} if objective != "ce" else {}))


def naive_mtp_loss(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS, weights_N, *,
                   z_loss: float = 0.0, vocab_size: int | None = None, objective: str = "ce"):
  """Reference: every head's logits materialised at once, O(nV + d). Tests and benchmarks."""
  return summarise(naive_mtp_sums(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS,
                                  vocab_size=vocab_size, objective=objective), weights_N, z_loss)


def naive_mtp_sums(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS, *,
                   vocab_size: int | None = None, objective: str = "ce", accept: bool = False):
  """`mtp_sums` with every head's logits at once (and the teachers': head 1's, shifted)."""
  N = h_NxBxSxD.shape[0]
  tgt_NxBxS, mask_NxBxS = targets_and_mask(tokens_BxS, segment_ids_BxS, N)
  logits_NxBxSxV = jnp.einsum("nbsd,dv->nbsv", h_NxBxSxD,
                              unembed_DxV.astype(h_NxBxSxD.dtype),
                              preferred_element_type=jnp.float32)
  if vocab_size is not None:
    logits_NxBxSxV = mask_pad_logits(logits_NxBxSxV, vocab_size)
  logp_NxBxSxV = jax.nn.log_softmax(logits_NxBxSxV, axis=-1)
  lse_NxBxS = jax.nn.logsumexp(logits_NxBxSxV, axis=-1)
  m = mask_NxBxS.astype(jnp.float32)
  nll_N = -jnp.sum(jnp.take_along_axis(logp_NxBxSxV, tgt_NxBxS[..., None], -1)[..., 0] * m,
                   axis=(1, 2))
  zsq_N = jnp.sum(jnp.square(lse_NxBxS) * m, axis=(1, 2))
  pred_NxBxS = jnp.argmax(logits_NxBxSxV, axis=-1).astype(jnp.int32)
  sums = _head_sums(nll_N, zsq_N, pred_NxBxS, tgt_NxBxS, mask_NxBxS)
  if (objective == "ce" and not accept) or N == 1:
    return sums
  head1_BxSxV = jax.lax.stop_gradient(logits_NxBxSxV[0])
  div = lambda kind: [jnp.sum(divergence(jnp.roll(head1_BxSxV, -k, axis=1), logits_NxBxSxV[k],
                                         kind) * m[k]) for k in range(1, N)]
  sums = dict(sums, tv=jax.lax.stop_gradient(jnp.stack([jnp.zeros(()), *div("tv")])))
  return sums if objective == "ce" else dict(sums, objective=jnp.stack([nll_N[0], *div(objective)]))


def _forward(params, model, batch):
  """h_NxBxSxD of a batch; a batch may carry the frozen trunk's output as "trunk_states" (heads
  trained on a frozen trunk: model.trunk_states, computed once per window)."""
  return model.apply({"params": params}, batch["tokens"], batch.get("segment_ids"),
                     trunk_states_BxSxD=batch.get("trunk_states"))[0]


def model_sums(params, model, config, batch, frozen_heads: int = 0, accept: bool = False,
               draft_ids=None):
  """Forward the model and the per-head loss sums (`mtp_sums`) of a batch: what a train step
  accumulates over micro-batches (`accept`: with the sampled acceptance's sums, for evals)."""
  h_NxBxSxD = _forward(params, model, batch)
  return mtp_sums(h_NxBxSxD, unembedding(params, model.args), batch["tokens"],
                  batch.get("segment_ids"), token_chunks=config.loss.token_chunks,
                  vocab_size=model.args.vocab_size, frozen_heads=frozen_heads,
                  dot=layers.dot_general(model.args), objective=config.loss.draft_objective,
                  accept=accept, draft_ids=draft_ids)


def model_loss(params, model, config, batch, *, naive: bool = False):
  """Forward the model and the loss from a config: what eval_step and the tests call."""
  w = head_weights(config)
  if naive:
    h_NxBxSxD = _forward(params, model, batch)
    return naive_mtp_loss(h_NxBxSxD, unembedding(params, model.args), batch["tokens"],
                          batch.get("segment_ids"), w, z_loss=config.loss.z_loss,
                          vocab_size=model.args.vocab_size, objective=config.loss.draft_objective)
  return summarise(model_sums(params, model, config, batch), w, config.loss.z_loss)
