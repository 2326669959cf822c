"""The compiled loop of chain decoding (`mtp_jax.decoding.decode` documents the method): one jit,
lax.while_loop over a `DecodeState`, static shapes, per-row lengths; a greedy cycle
(`greedy_cycle`) and a sampled one (`sampled_cycle`). Shared with the tree loop
(`mtp_jax.decoding.tree`): the greedy acceptance rule of a cycle (`accept_greedy`), what a row
gains (`gain`), the first state (`start`), the state after a cycle (`commit`) and the loop
(`run`).

`max_cycles` (traced) stops the loop after that many verification forwards whatever the rows'
state: the same compiled program serves a short probe (`mtp_jax.decoding.costmodel`) and a full run.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from mtp_jax import heads
from mtp_jax.heads import head_logits
from mtp_jax.decoding import sampling as sampling_lib
from mtp_jax.decoding.forward import Forward
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
  layout: Any = None  # a dynamic tree's per-row tables (`tree.Layout`; else None)


def start(cache, first_B, drafts_BxK1, q_BxK1xV, prompt_len_B, *, pad_id, eos_id,
          max_new_tokens: int, k: int, hist: int, layout=None) -> DecodeState:
  """The state after prefill: each row's first token out, `hist` histogram bins per row."""
  B = first_B.shape[0]
  return DecodeState(
      cache=cache,
      out_BxM=jnp.full((B, max_new_tokens + k), pad_id, jnp.int32).at[:, 0].set(first_B),
      n_out_B=jnp.ones((B,), jnp.int32),
      pos_B=prompt_len_B.astype(jnp.int32),
      last_B=first_B,
      drafts_BxK1=drafts_BxK1,
      q_BxK1xV=q_BxK1xV,
      done_B=(first_B == eos_id) | (max_new_tokens <= 1),
      cycles_B=jnp.zeros((B,), jnp.int32),
      hist_BxX=jnp.zeros((B, hist), jnp.int32),
      forwards=jnp.ones((), jnp.int32),
      layout=layout,
  )


def budget(s: DecodeState, max_new_tokens: int) -> jax.Array:
  """[B] tokens each row may still emit this cycle (0 for a finished row)."""
  return jnp.where(~s.done_B, max_new_tokens - s.n_out_B, 0)


def commit(s: DecodeState, acc: Accepted, out_BxK, cache, drafts_BxK1, hist_B, *,
           max_new_tokens: int, q_BxK1xV=None, stop_m=None, layout=None) -> DecodeState:
  """The state after a cycle (chain or tree): the row's gained tokens out_BxK[:, :acc.new_B]
  written, its length, position and newest token advanced, the next drafts (and, sampling, their
  distributions; a dynamic tree, its layout) kept, bin hist_B of its histogram counted; finished
  rows keep their state. With stop sequences (stop_m), the gained tokens are fed and a row whose
  cut is decided is done."""
  active_B = ~s.done_B
  keep = lambda new, old: jnp.where(active_B.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
  rows_B = jnp.arange(out_BxK.shape[0])
  j_K = jnp.arange(out_BxK.shape[1])
  idx_BxK = jnp.where(j_K < acc.new_B[:, None], s.n_out_B[:, None] + j_K, s.out_BxM.shape[1])
  n_out_B = s.n_out_B + acc.new_B
  stop, stopped_B = s.stop, False
  if stop_m is not None:
    stop = stops_lib.feed(stop_m, s.stop, out_BxK, acc.new_B)
    stopped_B = stops_lib.finished(stop_m, stop)
  if q_BxK1xV is not None:
    q_BxK1xV = keep(q_BxK1xV, s.q_BxK1xV)
  if layout is not None:
    layout = jax.tree.map(keep, layout, s.layout)
  return DecodeState(
      cache=cache,
      out_BxM=s.out_BxM.at[rows_B[:, None], idx_BxK].set(out_BxK, mode="drop"),
      n_out_B=n_out_B, pos_B=s.pos_B + acc.new_B, last_B=acc.last_B,
      drafts_BxK1=keep(drafts_BxK1, s.drafts_BxK1),
      q_BxK1xV=q_BxK1xV,
      done_B=s.done_B | (active_B & (acc.eos_B | (n_out_B >= max_new_tokens) | stopped_B)),
      cycles_B=s.cycles_B + active_B,
      hist_BxX=s.hist_BxX + (jax.nn.one_hot(hist_B, s.hist_BxX.shape[1], dtype=jnp.int32)
                             * active_B[:, None]),
      forwards=s.forwards + 1, stop=stop, layout=layout)


def run(cycle, state: DecodeState, max_cycles, max_new_tokens: int):
  """The loop: cycles until every row is done or max_cycles verification forwards ran; returns
  (tokens [B, max_new_tokens], lengths, cycles per row, histogram per row, forwards)."""
  s = jax.lax.while_loop(lambda s: ~jnp.all(s.done_B) & (s.forwards <= max_cycles), cycle,
                         state)
  return s.out_BxM[:, :max_new_tokens], s.n_out_B, s.cycles_B, s.hist_BxX, s.forwards


def draft_dists(h_K1xBxSxD, W_DxV, slot_B, sp):
  """[B, k-1, V]: heads 2..k's sampling distributions at each row's slot (logits as
  heads/sequential.py computes them, so a sequential chain draws the same drafts), unembedded
  there only (not at every window position: on SmolLM2 each is a 576 x 49,152 product)."""
  rows_B = jnp.arange(slot_B.shape[0])
  if h_K1xBxSxD.shape[0] == 0:
    return jnp.zeros((slot_B.shape[0], 0, W_DxV.shape[1]), jnp.float32)
  return jnp.stack([sampling_lib.probs(head_logits(h_BxSxD[rows_B, slot_B][:, None], W_DxV)[:, 0],
                                       sp) for h_BxSxD in h_K1xBxSxD], axis=1)


def read_slots(slot_B, k: int) -> jax.Array:
  """[B, max(k - 2, 1)]: the window positions slot - k + 3 .. slot (clipped at 0), where a cycle
  has sequential depths draft. Depth d + 1 reads depth d's draft at a position s only where
  x_{s+d+1} is not known (s + d > slot), positions past the slot are rolled back, and depth
  k - 1's draft is read by no depth: so depth d needs its draft at most d positions back, and
  no depth more than k - 2. (The next drafts the loop draws itself, at the slot.)"""
  return jnp.maximum(slot_B[:, None] - jnp.arange(max(k - 2, 1))[::-1], 0)


def argmax_drafts(c: Chain, h_K1xBxSxD, slot_B) -> jax.Array:
  """[B, k-1]: heads 2..k's argmax at each row's slot (unembedded there only)."""
  h_K1xBxD = h_K1xBxSxD[:, jnp.arange(slot_B.shape[0]), slot_B]
  return jnp.argmax(logits(c.params, c.args, h_K1xBxD[:, :, None])[:, :, 0],
                    axis=-1).T.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Chain:
  """What the chain loop's steps read, fixed for one trace: the (unrolled) params and args, the
  forward in two phases, the unembedding, EOS, the budget, stops."""
  params: Any
  args: ModelArgs
  fwd: Forward
  W_DxV: jax.Array
  eos_id: jax.Array
  max_new_tokens: int
  stop_m: Any = None

  @property
  def k(self) -> int:
    return self.args.n_future


def prefill(c: Chain, cache, prompt_BxP, prompt_len_B, first_token, pick, u_DxB):
  """The padded prompt at positions 0..P-1, each row reading its heads at len - 1; slots past a
  row's length hold pad states that the causal mask never shows it. Phase one gives head 1 and
  the first token (`first_token(h1_BxD)`); in phase two sequential depths read the prompt
  itself, then the first token, as in training, and draft with `pick` (None: argmax) at the
  prompt's last k - 1 positions. Returns (h1_BxPxD, h_K1xBxPxD, first token [B], cache, those
  positions [B, max(k - 1, 1)])."""
  B, P = prompt_BxP.shape
  rows_B = jnp.arange(B)
  last_P_B = prompt_len_B - 1
  pos_BxP = jnp.broadcast_to(jnp.arange(P), (B, P))
  h1_BxPxD, z_BxPxD, cache = c.fwd.first(prompt_BxP, pos_BxP, cache)
  first_B = first_token(h1_BxPxD[rows_B, last_P_B])
  after_BxP = jnp.concatenate([prompt_BxP[:, 1:], prompt_BxP[:, :1]], axis=1)
  after_BxP = jnp.where(jnp.arange(P) == last_P_B[:, None], first_B[:, None], after_BxP)
  slots_BxN = jnp.maximum(last_P_B[:, None] - jnp.arange(max(c.k - 1, 1))[::-1], 0)
  h_K1xBxPxD, cache = c.fwd.rest(prompt_BxP, pos_BxP, cache, z_BxPxD, heads.Drafting(
      slot_B=last_P_B, after_BxS=after_BxP, pick=pick, u_DxB=u_DxB, slots_BxN=slots_BxN,
      unembed_DxV=c.W_DxV))
  return h1_BxPxD, h_K1xBxPxD, first_B, cache, slots_BxN


def greedy_start(c: Chain, cache, prompt_BxP, prompt_len_B):
  """Greedy prefill: (first token [B], drafts [B, k-1], None, cache)."""
  first_token = lambda h1_BxD: jnp.argmax(head_logits(h1_BxD[:, None], c.W_DxV)[:, 0],
                                          axis=-1).astype(jnp.int32)
  _, h_K1xBxPxD, first_B, cache, _ = prefill(c, cache, prompt_BxP, prompt_len_B, first_token,
                                             None, None)
  return first_B, argmax_drafts(c, h_K1xBxPxD, prompt_len_B - 1), None, cache


def greedy_cycle(c: Chain, s: DecodeState) -> DecodeState:
  """A greedy cycle: the window [last, drafts] verified by head 1's argmax (`accept_greedy`,
  between the forward's two phases); heads 2..k at the last accepted slot propose the next
  drafts (unembedded there only)."""
  k = c.k
  window_BxK = jnp.concatenate([s.last_B[:, None], s.drafts_BxK1], axis=1)
  pos_BxK = s.pos_B[:, None] + jnp.arange(k)
  h1_BxKxD, z_BxKxD, cache = c.fwd.first(window_BxK, pos_BxK, s.cache)
  g_BxK = jnp.argmax(head_logits(h1_BxKxD, c.W_DxV), axis=-1).astype(jnp.int32)
  acc = accept_greedy(s.drafts_BxK1, g_BxK, s.last_B, c.eos_id, budget(s, c.max_new_tokens))
  h_K1xBxKxD, cache = c.fwd.rest(window_BxK, pos_BxK, cache, z_BxKxD,
                                 heads.Drafting(slot_B=acc.drafts_B, after_BxS=g_BxK,
                                                slots_BxN=read_slots(acc.drafts_B, k),
                                                unembed_DxV=c.W_DxV))
  drafts_BxK1 = argmax_drafts(c, h_K1xBxKxD, acc.drafts_B)
  return commit(s, acc, g_BxK, cache, drafts_BxK1, acc.drafts_B,
                max_new_tokens=c.max_new_tokens, stop_m=c.stop_m)


# Sampling: the uniforms of a cycle (and of prefill, at the prompt's last position), per row:
# [:, :k-1] accept the drafts, [:, k-1] draws the next token, [:, k:] draw the next drafts.

def sampled_start(c: Chain, cache, prompt_BxP, prompt_len_B, sp, keys_B):
  """Sampled prefill: (first token [B], drafts [B, k-1], their distributions, cache)."""
  k, B = c.k, prompt_BxP.shape[0]
  u0_BxU = sampling_lib.uniforms(keys_B, prompt_len_B - 1, 2 * k - 1)

  def first_token(h1_BxD):
    lg_BxV = head_logits(h1_BxD[:, None], c.W_DxV)[:, 0]
    return sampling_lib.draw(sampling_lib.probs(lg_BxV, sp), u0_BxU[:, k - 1])

  _, h_K1xBxPxD, first_B, cache, slots_BxN = prefill(
      c, cache, prompt_BxP, prompt_len_B, first_token, sampling_lib.picker(sp), u0_BxU[:, k:].T)
  h_K1xBxNxD = jnp.take_along_axis(h_K1xBxPxD, slots_BxN[None, :, :, None], axis=2)
  q_BxK1xV = draft_dists(h_K1xBxNxD, c.W_DxV, jnp.full((B,), slots_BxN.shape[1] - 1), sp)
  return first_B, sampling_lib.draw(q_BxK1xV, u0_BxU[:, k:]), q_BxK1xV, cache


def sampled_cycle(c: Chain, sp, keys_B, s: DecodeState) -> DecodeState:
  """A sampled cycle: head 1's p verifies the drafts by the speculative sampling rule
  (`sampling.accept_sampled`, between the forward's two phases); heads 2..k at the last
  accepted slot draw the next drafts from their own distributions q."""
  k = c.k
  window_BxK = jnp.concatenate([s.last_B[:, None], s.drafts_BxK1], axis=1)
  pos_BxK = s.pos_B[:, None] + jnp.arange(k)
  u_BxU = sampling_lib.uniforms(keys_B, s.pos_B, 2 * k - 1)
  h1_BxKxD, z_BxKxD, cache = c.fwd.first(window_BxK, pos_BxK, s.cache)
  p_BxKxV = sampling_lib.probs(head_logits(h1_BxKxD, c.W_DxV), sp)
  m_B, next_B = sampling_lib.accept_sampled(s.drafts_BxK1, p_BxKxV, s.q_BxK1xV, u_BxU[:, :k])
  out_BxK = sampling_lib.cycle_tokens(s.drafts_BxK1, m_B, next_B)
  h_K1xBxKxD, cache = c.fwd.rest(window_BxK, pos_BxK, cache, z_BxKxD, heads.Drafting(
      slot_B=m_B, after_BxS=out_BxK, pick=sampling_lib.picker(sp), u_DxB=u_BxU[:, k:].T,
      slots_BxN=read_slots(m_B, k), unembed_DxV=c.W_DxV))
  acc = gain(out_BxK, m_B, s.last_B, c.eos_id, budget(s, c.max_new_tokens))
  q_BxK1xV = draft_dists(h_K1xBxKxD, c.W_DxV, acc.drafts_B, sp)
  drafts_BxK1 = sampling_lib.draw(q_BxK1xV, u_BxU[:, k:])
  return commit(s, acc, out_BxK, cache, drafts_BxK1, acc.drafts_B,
                max_new_tokens=c.max_new_tokens, q_BxK1xV=q_BxK1xV, stop_m=c.stop_m)


@functools.partial(jax.jit, static_argnames=("args", "max_new_tokens", "sample"))
def decode_chain(params, prompt_BxP, prompt_len_B, eos_id, pad_id, sp, seed, max_cycles,
                 stop_m=None, *, args: ModelArgs, max_new_tokens: int, sample: bool):
  """Chain decoding, greedy or (sample) sampled; returns (tokens [B, max_new_tokens], lengths,
  cycles per row, histogram of drafts accepted per row [B, k], forwards)."""
  params, args = unrolled(params, args)  # the layers' weights sliced once, not per cycle
  B, P = prompt_BxP.shape
  k = args.n_future
  c = Chain(params=params, args=args, fwd=Forward(MTPModel(args), params),
            W_DxV=unembedding(params, args)[:, :args.vocab_size],  # a pad id never wins
            eos_id=eos_id, max_new_tokens=max_new_tokens, stop_m=stop_m)
  cache = init_decode_cache(args, B, P + max_new_tokens + k, dtype=args.dtype)
  if sample:
    keys_B = sampling_lib.row_keys(seed, B)
    first = sampled_start(c, cache, prompt_BxP, prompt_len_B, sp, keys_B)
    cycle = functools.partial(sampled_cycle, c, sp, keys_B)
  else:
    first = greedy_start(c, cache, prompt_BxP, prompt_len_B)
    cycle = functools.partial(greedy_cycle, c)
  first_B, drafts_BxK1, q_BxK1xV, cache = first
  state = start(cache, first_B, drafts_BxK1, q_BxK1xV, prompt_len_B, pad_id=pad_id,
                eos_id=eos_id, max_new_tokens=max_new_tokens, k=k, hist=k)
  if stop_m is not None:  # stop sequences: a row is done once its cut is decided (stops.py)
    stop = stops_lib.feed(stop_m, stops_lib.init(B), first_B[:, None], jnp.ones((B,), jnp.int32))
    state = state.replace(stop=stop, done_B=state.done_B | stops_lib.finished(stop_m, stop))
  return run(cycle, state, max_cycles, max_new_tokens)
