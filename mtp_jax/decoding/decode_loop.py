"""The compiled loop of chain decoding (`mtp_jax.decoding.decode` documents the method): one jit,
lax.while_loop over a `DecodeState`, static shapes, per-row lengths; the greedy acceptance rule
of a cycle (`accept_greedy`) and what a row gains (`gain`), shared with the tree loop
(`mtp_jax.decoding.tree`).

`max_cycles` (traced) stops the loop after that many verification forwards whatever the rows'
state: the same compiled program serves a short probe (`mtp_jax.decoding.costmodel`) and a full run.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from mtp_jax import heads
from mtp_jax.decoding import sampling as sampling_lib
from mtp_jax.decoding import stops as stops_lib
from mtp_jax.model_args import ModelArgs
from mtp_jax.model import MTPModel, init_decode_cache, logits, unembedding, unrolled


class Accepted(NamedTuple):
  drafts_B: jax.Array  # m: drafts accepted, 0..k-1 (before any EOS or budget cut)
  new_B: jax.Array  # n: tokens the row gains, greedy[:, :n] (0 where the budget is 0)
  last_B: jax.Array  # the row's newest token afterwards: greedy[n - 1], or `last` if n = 0
  eos_B: jax.Array  # an EOS is among the n new tokens


def accept_greedy(drafts_BxK1, greedy_BxK, last_B, eos_id, budget_B) -> Accepted:
  """One cycle's greedy acceptance rule (Stern et al. 2018; Gloeckle et al. 2024 §3.2).

  greedy_BxK[:, j] is head 1's argmax at window slot j, the greedy token after the window's
  first j + 1 tokens; draft j + 1 (drafts_BxK1[:, j]) stands in slot j + 1, so it is accepted
  while it equals greedy[:, j] and every draft before it was accepted. With m accepted, the row
  gains greedy[:, :m + 1] (m drafts, all equal to greedy's own tokens, and head 1's next token),
  cut after the first EOS and to the budget (tokens the row may still emit, 0 for a finished
  row)."""
  k = greedy_BxK.shape[1]
  match_BxK1 = (drafts_BxK1 == greedy_BxK[:, :k - 1]).astype(jnp.int32)
  m_B = jnp.sum(jnp.cumprod(match_BxK1, axis=1), axis=1)
  return gain(greedy_BxK, m_B, last_B, eos_id, budget_B)


def gain(tokens_BxK, m_B, last_B, eos_id, budget_B) -> Accepted:
  """What a row gains in a cycle with m drafts accepted: tokens[:, :m + 1], cut after the first
  EOS and to the budget."""
  k = tokens_BxK.shape[1]
  j_K = jnp.arange(k)
  eos_BxK = (tokens_BxK == eos_id) & (j_K <= m_B[:, None])
  n_B = jnp.where(jnp.any(eos_BxK, axis=1), jnp.argmax(eos_BxK, axis=1) + 1, m_B + 1)
  n_B = jnp.minimum(n_B, budget_B)
  eos_B = jnp.any(eos_BxK & (j_K < n_B[:, None]), axis=1)
  rows_B = jnp.arange(tokens_BxK.shape[0])
  last_B = jnp.where(n_B > 0, tokens_BxK[rows_B, jnp.maximum(n_B - 1, 0)], last_B)
  return Accepted(m_B, n_B, last_B, eos_B)


@flax.struct.dataclass
class DecodeState:
  """The while-loop carry. M = max_new_tokens + k slots, so a cycle never writes past the end."""
  cache: Any
  out_BxM: jax.Array  # generated tokens, pad after n_out
  n_out_B: jax.Array
  pos_B: jax.Array  # position of `last`, the newest token, not yet fed
  last_B: jax.Array
  drafts_BxK1: jax.Array  # heads 2..k's proposals for the positions after `last`
  q_BxK1xV: Any  # sampling: the distributions the drafts were drawn from (greedy: None)
  done_B: jax.Array
  cycles_B: jax.Array  # cycles each row took part in
  hist_BxX: jax.Array  # per row: cycles accepting 0..k-1 drafts (a tree: by deepest node)
  forwards: jax.Array  # prefill + cycles
  stop: Any = None  # stops.StopState when decoding with stop sequences (else None)


def draft_dists(h_kxBxSxD, W_DxV, slot_B, sp):
  """[B, k-1, V]: heads 2..k's sampling distributions at each row's slot (logits as
  heads/sequential.py computes them, so a sequential chain draws the same drafts)."""
  rows_B = jnp.arange(slot_B.shape[0])
  if h_kxBxSxD.shape[0] == 1:
    return jnp.zeros((slot_B.shape[0], 0, W_DxV.shape[1]), jnp.float32)
  return jnp.stack([sampling_lib.probs(sampling_lib.head_logits(h_BxSxD, W_DxV)[rows_B, slot_B],
                                       sp) for h_BxSxD in h_kxBxSxD[1:]], axis=1)


@functools.partial(jax.jit, static_argnames=("args", "max_new_tokens", "sample"))
def decode_chain(params, prompt_BxP, prompt_len_B, eos_id, pad_id, sp, seed, max_cycles,
                 stop_m=None, *, args: ModelArgs, max_new_tokens: int, sample: bool):
  params, args = unrolled(params, args)  # the layers' weights sliced once, not per cycle
  model = MTPModel(args)
  chain_reads = heads.KINDS[args.head_kind].decode_reads  # what the heads read (None: nothing)
  k = args.n_future
  B, P = prompt_BxP.shape
  D = max(k - 1, 1)
  rows_B = jnp.arange(B)
  W_DxV = unembedding(params, args)[:, :args.vocab_size]  # real ids only: a pad id never wins
  cache = init_decode_cache(args, B, P + max_new_tokens + k, dtype=args.dtype)
  apply = lambda toks, pos, c, reads: model.apply(
      {"params": params}, toks, positions_BxS=pos, cache=c, decoding=True, reads=reads)
  keys_B = sampling_lib.row_keys(seed, B) if sample else None
  last_P_B = prompt_len_B - 1
  sp_chain = sp if sample else None
  # Uniforms of a cycle (and of prefill, at the prompt's last position): [:, :k-1] accept the
  # drafts, [:, k-1] draws the next token, [:, k:] draw the next drafts.
  u0_BxU = sampling_lib.uniforms(keys_B, last_P_B, 2 * k - 1) if sample else None

  def first_token(h1_BxD):
    lg_BxV = sampling_lib.head_logits(h1_BxD[:, None], W_DxV)[:, 0]
    if not sample:
      return jnp.argmax(lg_BxV, axis=-1).astype(jnp.int32)
    return sampling_lib.draw(sampling_lib.probs(lg_BxV, sp), u0_BxU[:, k - 1])

  # Prefill: the padded prompt at positions 0..P-1; each row reads its heads at len - 1.
  # Slots past a row's length hold pad states that the causal mask never shows it. Sequential
  # depths read the prompt itself (then the first token), as in training.
  def prefill_known(h1_BxPxD):
    first_B = first_token(h1_BxPxD[rows_B, last_P_B])
    after_BxP = jnp.concatenate([prompt_BxP[:, 1:], prompt_BxP[:, :1]], axis=1)
    after_BxP = jnp.where(jnp.arange(P) == last_P_B[:, None], first_B[:, None], after_BxP)
    return after_BxP, last_P_B

  slots_BxN = jnp.maximum(last_P_B[:, None] - jnp.arange(D)[::-1], 0)
  reads = chain_reads(prefill_known, W_DxV, sp_chain, u0_BxU[:, k:].T if sample else None,
                      slots_BxN)
  h_kxBxPxD, cache = apply(prompt_BxP, jnp.broadcast_to(jnp.arange(P), (B, P)), cache, reads)
  if sample:
    first_B = first_token(h_kxBxPxD[0, rows_B, last_P_B])
    h_kxBxNxD = jnp.take_along_axis(h_kxBxPxD, slots_BxN[None, :, :, None], axis=2)
    q_BxK1xV = draft_dists(h_kxBxNxD, W_DxV, jnp.full((B,), D - 1), sp)
    drafts_BxK1 = sampling_lib.draw(q_BxK1xV, u0_BxU[:, k:])
  else:
    h_kxBxD = h_kxBxPxD[:, rows_B, last_P_B]
    tok_kxB = jnp.argmax(logits(params, args, h_kxBxD[:, :, None])[:, :, 0], axis=-1)
    first_B = tok_kxB[0].astype(jnp.int32)
    drafts_BxK1, q_BxK1xV = tok_kxB[1:].T.astype(jnp.int32), None
  M = max_new_tokens + k
  state = DecodeState(
      cache=cache,
      out_BxM=jnp.full((B, M), pad_id, jnp.int32).at[:, 0].set(first_B),
      n_out_B=jnp.ones((B,), jnp.int32),
      pos_B=prompt_len_B.astype(jnp.int32),
      last_B=first_B,
      drafts_BxK1=drafts_BxK1,
      q_BxK1xV=q_BxK1xV,
      done_B=(first_B == eos_id) | (max_new_tokens <= 1),
      cycles_B=jnp.zeros((B,), jnp.int32),
      hist_BxX=jnp.zeros((B, k), jnp.int32),
      forwards=jnp.ones((), jnp.int32),
  )
  if stop_m is not None:  # stop sequences: a row is done once its cut is decided (stops.py)
    stop = stops_lib.feed(stop_m, stops_lib.init(B), first_B[:, None], jnp.ones((B,), jnp.int32))
    state = state.replace(stop=stop, done_B=state.done_B | stops_lib.finished(stop_m, stop))
  j_K = jnp.arange(k)

  def cycle(s: DecodeState) -> DecodeState:
    window_BxK = jnp.concatenate([s.last_B[:, None], s.drafts_BxK1], axis=1)
    active_B = ~s.done_B
    budget_B = jnp.where(active_B, max_new_tokens - s.n_out_B, 0)
    if sample:
      u_BxU = sampling_lib.uniforms(keys_B, s.pos_B, 2 * k - 1)

      def rule(h1_BxKxD):  # head 1's p, then the acceptance rule: (m accepted, next token)
        p_BxKxV = sampling_lib.probs(sampling_lib.head_logits(h1_BxKxD, W_DxV), sp)
        return sampling_lib.accept_sampled(s.drafts_BxK1, p_BxKxV, s.q_BxK1xV, u_BxU[:, :k])

      def known(h1_BxKxD):
        m_B, next_B = rule(h1_BxKxD)
        return sampling_lib.cycle_tokens(s.drafts_BxK1, m_B, next_B), m_B

      reads = chain_reads(known, W_DxV, sp, u_BxU[:, k:].T)
      h_kxBxKxD, cache = apply(window_BxK, s.pos_B[:, None] + j_K, s.cache, reads)
      m_B, next_B = rule(h_kxBxKxD[0])
      out_BxK = sampling_lib.cycle_tokens(s.drafts_BxK1, m_B, next_B)
      acc = gain(out_BxK, m_B, s.last_B, eos_id, budget_B)
      q_BxK1xV = draft_dists(h_kxBxKxD, W_DxV, acc.drafts_B, sp)
      new_drafts_BxK1 = sampling_lib.draw(q_BxK1xV, u_BxU[:, k:])
      q_BxK1xV = jnp.where(active_B[:, None, None], q_BxK1xV, s.q_BxK1xV)
    else:
      def known(h1_BxKxD):
        g_BxK = jnp.argmax(sampling_lib.head_logits(h1_BxKxD, W_DxV), axis=-1).astype(jnp.int32)
        return g_BxK, accept_greedy(s.drafts_BxK1, g_BxK, s.last_B, eos_id, budget_B).drafts_B

      reads = chain_reads(known, W_DxV, None)
      h_kxBxKxD, cache = apply(window_BxK, s.pos_B[:, None] + j_K, s.cache, reads)
      g_BxK = jnp.argmax(sampling_lib.head_logits(h_kxBxKxD[0], W_DxV),
                         axis=-1).astype(jnp.int32)
      acc = accept_greedy(s.drafts_BxK1, g_BxK, s.last_B, eos_id, budget_B)
      out_BxK = g_BxK
      # Heads 2..k at the last accepted slot propose the next drafts (unembedded there only).
      h_kxBxD = h_kxBxKxD[1:, rows_B, acc.drafts_B]
      new_drafts_BxK1 = jnp.argmax(logits(params, args, h_kxBxD[:, :, None])[:, :, 0],
                                   axis=-1).T.astype(jnp.int32)
      q_BxK1xV = None
    idx_BxK = jnp.where(j_K < acc.new_B[:, None], s.n_out_B[:, None] + j_K, M)
    n_out_B = s.n_out_B + acc.new_B
    stop, stopped_B = s.stop, False
    if stop_m is not None:
      stop = stops_lib.feed(stop_m, s.stop, out_BxK, acc.new_B)
      stopped_B = stops_lib.finished(stop_m, stop)
    return DecodeState(
        cache=cache,
        out_BxM=s.out_BxM.at[rows_B[:, None], idx_BxK].set(out_BxK, mode="drop"),
        n_out_B=n_out_B, pos_B=s.pos_B + acc.new_B, last_B=acc.last_B,
        drafts_BxK1=jnp.where(active_B[:, None], new_drafts_BxK1, s.drafts_BxK1),
        q_BxK1xV=q_BxK1xV,
        done_B=s.done_B | (active_B & (acc.eos_B | (n_out_B >= max_new_tokens) | stopped_B)),
        cycles_B=s.cycles_B + active_B,
        hist_BxX=s.hist_BxX + (jax.nn.one_hot(acc.drafts_B, k, dtype=jnp.int32)
                               * active_B[:, None]),
        forwards=s.forwards + 1, stop=stop)

  s = jax.lax.while_loop(lambda s: ~jnp.all(s.done_B) & (s.forwards <= max_cycles), cycle,
                         state)
  return s.out_BxM[:, :max_new_tokens], s.n_out_B, s.cycles_B, s.hist_BxX, s.forwards
