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

Everything is first a per-head sum over tokens (`mtp_sums`: NLL, lse^2, correct, agreeing,
scored tokens); `summarise` divides once per head. Sums add up across micro-batches, so a
gradient-accumulating train step (steps.py) reproduces the full batch's per-head token means.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mtp_jax import config as config_lib
from mtp_jax import backends, layers, sharding
from mtp_jax.model import mask_pad_logits, unembedding

_SAVE_NOTHING = jax.checkpoint_policies.nothing_saveable


def head_weights(config: ml_collections.ConfigDict) -> np.ndarray:
  """lambda_i for i = 1..n_future from `config.loss`."""
  n, lo = config.model.n_future, config.loss
  scheme = config_lib.parse_head_weights(lo.head_weights)
  if not isinstance(scheme, str):
    return np.asarray(scheme, np.float32)
  if lo.head_weights == "uniform":
    return np.ones(n, np.float32)
  if lo.head_weights == "geometric":
    return lo.geometric_decay ** np.arange(n, dtype=np.float32)
  if lo.head_weights == "deepseek":  # DeepSeek-V3 eq. 25: L_main + lambda / D * sum_k L_k
    return np.asarray([1.0] + [lo.mtp_lambda / max(n - 1, 1)] * (n - 1), np.float32)
  raise ValueError(f"config.loss.head_weights: unknown {lo.head_weights!r}")


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


def _token_stats(h_BxTxD, unembed_DxV, tgt_BxT, mask_BxT, vocab_size, dot=jax.lax.dot_general):
  """Summed NLL and summed lse^2 over the masked tokens, and the argmax, for one tile."""
  B, T, D = h_BxTxD.shape  # one token axis: XLA:CPU's fast GEMM path (see layers.tokens_2d)
  logits_BxTxV = dot(h_BxTxD.reshape(B * T, D), unembed_DxV.astype(h_BxTxD.dtype),
                     (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  logits_BxTxV = logits_BxTxV.reshape(B, T, -1)
  # On a mesh, keep the tile's rows with their batch shard: unconstrained, GSPMD all-gathered
  # the whole global tile onto every chip (33.5 GB at 7B scale, found with plan_memory).
  logits_BxTxV = sharding.constrain(logits_BxTxV, ("batch", None, "vocab"))
  logits_BxTxV = mask_pad_logits(logits_BxTxV, vocab_size)
  lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
  tgt_logit_BxT = jnp.take_along_axis(logits_BxTxV, tgt_BxT[..., None], axis=-1)[..., 0]
  m = mask_BxT.astype(jnp.float32)
  nll = jnp.sum((lse_BxT - tgt_logit_BxT) * m)
  zsq = jnp.sum(jnp.square(lse_BxT) * m)
  return nll, zsq, jnp.argmax(logits_BxTxV, axis=-1).astype(jnp.int32)


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
  N = pred_NxBxS.shape[0]
  agree = []
  for k in range(N):
    head1_at_BxS = jnp.pad(pred_NxBxS[0][:, k:], ((0, 0), (0, k)))
    agree.append(jnp.sum((pred_NxBxS[k] == head1_at_BxS) & mask_NxBxS[k]))
  return {
      "nll": nll_N,
      "zsq": zsq_N,
      "correct": correct_N.astype(jnp.float32),
      "agree": jnp.stack(agree).astype(jnp.float32),
      "tokens": jnp.sum(mask_NxBxS, axis=(1, 2)).astype(jnp.float32),
  }


def weighted_loss(sums, weights_N, z_loss: float, count_N=None):
  """sum_i lambda_i * (NLL_i + z * lse_i^2) / count_i. `count_N` defaults to the sums' own token
  counts; a micro-batch passes the whole batch's, so its losses add up to the batch's loss."""
  denom_N = jnp.maximum(sums["tokens"] if count_N is None else count_N, 1.0)
  per_head_N = sums["nll"] / denom_N + z_loss * sums["zsq"] / denom_N
  return jnp.sum(jnp.asarray(weights_N) * per_head_N)


def summarise(sums, weights_N, z_loss: float):
  """Scalar loss and per-head metrics (means over each head's own tokens) from per-head sums."""
  denom_N = jnp.maximum(sums["tokens"], 1.0)
  metrics = {
      "loss": weighted_loss(sums, weights_N, z_loss),
      "head_loss": sums["nll"] / denom_N,
      "head_acc": sums["correct"] / denom_N,
      "head_agree": sums["agree"] / denom_N,
      "head_tokens": sums["tokens"],
  }
  return metrics["loss"], metrics


def mtp_loss(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS, weights_N, *,
             token_chunks: int = 1, z_loss: float = 0.0, vocab_size: int | None = None):
  """Memory-lean MTP loss. Returns (scalar loss, metrics with per-head [N] arrays). Columns of
  unembed_DxV from `vocab_size` on are padding (None: every column is a real id)."""
  sums = mtp_sums(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS, token_chunks=token_chunks,
                  vocab_size=vocab_size)
  return summarise(sums, weights_N, z_loss)


def mtp_sums(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS, *, token_chunks: int = 1,
             vocab_size: int | None = None, frozen_heads: int = 0, dot=jax.lax.dot_general):
  """Per-head sums (nll, zsq, correct, agree, tokens; each [N]) of the memory-lean loss. The
  first `frozen_heads` heads get no gradient (optim.trainable = "heads": head 1 depends on
  frozen params only), so their logits are never differentiated. `dot`: the logits' product
  (layers.dot_general: XLA's, or MKL's on one CPU device)."""
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

  def tile(_, xs):
    return None, _token_stats(xs[0], unembed_DxV, xs[1], xs[2], V, dot)

  def head(_, xs):
    h_BxSxD, tgt_BxS, mask_BxS = xs
    if C == 1:
      return None, _token_stats(h_BxSxD, unembed_DxV, tgt_BxS, mask_BxS, V, dot)
    split = lambda a: jnp.moveaxis(a.reshape(B, C, S // C, *a.shape[2:]), 1, 0)
    _, (nll_C, zsq_C, pred_CxBxT) = jax.lax.scan(
        jax.checkpoint(tile, policy=_SAVE_NOTHING), None,
        (split(h_BxSxD), split(tgt_BxS), split(mask_BxS)))
    return None, (nll_C.sum(), zsq_C.sum(), jnp.moveaxis(pred_CxBxT, 0, 1).reshape(B, S))

  def scan(*xs):
    return jax.lax.scan(jax.checkpoint(head, policy=_SAVE_NOTHING), None, xs)[1]

  F = min(frozen_heads, N)
  if F == 0:
    nll_N, zsq_N, pred_NxBxS = scan(h_NxBxSxD, tgt_NxBxS, mask_NxBxS)
  else:  # the first F heads forward only: no backward pass through their logits
    frozen = scan(jax.lax.stop_gradient(h_NxBxSxD[:F]), tgt_NxBxS[:F], mask_NxBxS[:F])
    nll_N, zsq_N, pred_NxBxS = frozen
    if F < N:
      rest = scan(h_NxBxSxD[F:], tgt_NxBxS[F:], mask_NxBxS[F:])
      nll_N, zsq_N, pred_NxBxS = (jnp.concatenate(x) for x in zip(frozen, rest))
  return _head_sums(nll_N, zsq_N, pred_NxBxS, tgt_NxBxS, mask_NxBxS)


def naive_mtp_loss(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS, weights_N, *,
                   z_loss: float = 0.0, vocab_size: int | None = None):
  """Reference: every head's logits materialised at once, O(nV + d). Tests and benchmarks."""
  return summarise(naive_mtp_sums(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS,
                                  vocab_size=vocab_size), weights_N, z_loss)


def naive_mtp_sums(h_NxBxSxD, unembed_DxV, tokens_BxS, segment_ids_BxS, *,
                   vocab_size: int | None = None):
  """`mtp_sums` with every head's logits at once."""
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
  return _head_sums(nll_N, zsq_N, pred_NxBxS, tgt_NxBxS, mask_NxBxS)


def model_sums(params, model, config, batch, frozen_heads: int = 0):
  """Forward the model and the per-head loss sums (`mtp_sums`) of a batch: what a train step
  accumulates over micro-batches."""
  h_NxBxSxD, _ = model.apply({"params": params}, batch["tokens"], batch.get("segment_ids"))
  return mtp_sums(h_NxBxSxD, unembedding(params, model.args), batch["tokens"],
                  batch.get("segment_ids"), token_chunks=config.loss.token_chunks,
                  vocab_size=model.args.vocab_size, frozen_heads=frozen_heads,
                  dot=layers.dot_general(model.args))


def model_loss(params, model, config, batch, *, naive: bool = False):
  """Forward the model and the loss from a config: what eval_step and the tests call."""
  w = head_weights(config)
  if naive:
    h_NxBxSxD, _ = model.apply({"params": params}, batch["tokens"], batch.get("segment_ids"))
    return naive_mtp_loss(h_NxBxSxD, unembedding(params, model.args), batch["tokens"],
                          batch.get("segment_ids"), w, z_loss=config.loss.z_loss,
                          vocab_size=model.args.vocab_size)
  return summarise(model_sums(params, model, config, batch), w, config.loss.z_loss)
