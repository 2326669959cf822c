"""Greedy and sampled decoding, plain and self-speculative with the MTP heads (Gloeckle et al.
2024 §3.2 and appendix A; blockwise parallel decoding, Stern et al. 2018; speculative sampling,
Leviathan et al. 2023 and Chen et al. 2023).

One cycle feeds [last accepted token, drafts d_1..d_{k-1}] at positions L..L+k-1 through the
trunk and heads 1..k with a KV cache. Head 1 at window slot j gives the token for position
L+j+1. Greedy: its argmax g_j; draft d_j is accepted while d_j == g_{j-1}; with m drafts accepted
the row gains g_0..g_m (m + 1 tokens). Sampling (temperature > 0, top-k, top-p;
`mtp_jax.sampling`): draft d_j was drawn from head j+1's truncated distribution q_j and is
accepted with probability min(1, p(d_j) / q_j(d_j)), p being head 1's; at the first rejection
the next token is drawn from normalise(max(0, p - q)), after k-1 acceptances from p (the bonus
token), so the output is distributed exactly as plain sampling from head 1. Either way heads
2..k at the last accepted slot propose the next drafts (drawn from their own distributions when
sampling). Cache slots past the new length hold rejected states; they are never read before
being overwritten (rollback by length). k = 1 is plain decoding with head 1 only, on the same
machinery; greedy output equals head 1's greedy output token for token.

The whole loop is one jit: lax.while_loop over a `DecodeState`, static shapes, per-row lengths;
rows that hit EOS or max_new_tokens stop (their slots are frozen) while the others go on. The
rules of a cycle are pure functions: `accept_greedy` here, `sampling.accept_sampled`. Randomness
is per row (`sampling.row_keys`), so a row's samples do not depend on the rest of the batch.
`Decoder` compiles the loop ahead of time for one batch shape (jax.jit caches the program;
nothing here keeps a cache of its own).

Sequential (DeepSeek-V3) heads decode in chain mode: depth j reads x_{t+j} where it is known
(the prompt at prefill, the accepted drafts and the new token in a cycle: teacher forcing, as in
training) and otherwise depth j-1's draft at the same position (its argmax, or its draw), so one
forward yields k-1 chained drafts at the last accepted position (`HeadKind.decode_reads`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import heads
from mtp_jax import sampling as sampling_lib
from mtp_jax.model_args import ModelArgs
from mtp_jax.model import MTPModel, init_decode_cache, logits, unembedding


def check_heads(args: ModelArgs, k: int) -> None:
  if not 1 <= k <= args.n_future:
    raise ValueError(f"--heads: must be between 1 and the model's n_future ({args.n_future}), "
                     f"got {k}")


def slice_heads(params, args: ModelArgs, k: int):
  """Params and args of the model restricted to heads 1..k (k <= n_future)."""
  check_heads(args, k)
  params = heads.slice_params(params, heads.KINDS[args.head_kind], k)
  return params, dataclasses.replace(args, n_future=k)


@dataclasses.dataclass
class DecodeResult:
  tokens: np.ndarray  # [B, max_new_tokens] generated ids, pad after each row's length
  lengths: np.ndarray  # [B] generated tokens per row (an EOS counts and ends the row)
  cycles: np.ndarray  # [B] verification forwards each row took part in (prefill excluded)
  accepted_hist: np.ndarray  # [k] how often 0..k-1 drafts were accepted, over row-cycles
  forwards: int  # model calls: prefill + cycles
  seconds: float = 0.0  # wall time of the compiled decode (compilation excluded)
  compile_seconds: float = 0.0  # of the `Decoder` that ran it (~0 when jax had it cached)

  @property
  def tokens_per_forward(self) -> float:
    """a: mean tokens gained per verification forward (the first token, from prefill, aside)."""
    return float((self.lengths - 1).sum() / max(self.cycles.sum(), 1))

  def acceptance_by_position(self) -> np.ndarray:
    """P(draft j accepted), j = 1..k-1: the chance that at least j drafts pass in a cycle."""
    h = self.accepted_hist
    return np.asarray([h[j:].sum() / max(h.sum(), 1) for j in range(1, len(h))])


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
  hist_K: jax.Array  # how often 0..k-1 drafts were accepted, over row-cycles
  forwards: jax.Array  # prefill + cycles


def _draft_dists(h_kxBxSxD, W_DxV, slot_B, sp):
  """[B, k-1, V]: heads 2..k's sampling distributions at each row's slot (logits as
  heads/sequential.py computes them, so a sequential chain draws the same drafts)."""
  rows_B = jnp.arange(slot_B.shape[0])
  if h_kxBxSxD.shape[0] == 1:
    return jnp.zeros((slot_B.shape[0], 0, W_DxV.shape[1]), jnp.float32)
  return jnp.stack([sampling_lib.probs(sampling_lib.head_logits(h_BxSxD, W_DxV)[rows_B, slot_B],
                                       sp) for h_BxSxD in h_kxBxSxD[1:]], axis=1)


@functools.partial(jax.jit, static_argnames=("args", "max_new_tokens", "sample"))
def _decode(params, prompt_BxP, prompt_len_B, eos_id, pad_id, sp, seed, *, args: ModelArgs,
            max_new_tokens: int, sample: bool):
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
    q_BxK1xV = _draft_dists(h_kxBxNxD, W_DxV, jnp.full((B,), D - 1), sp)
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
      hist_K=jnp.zeros((k,), jnp.int32),
      forwards=jnp.ones((), jnp.int32),
  )
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
        return sampling_lib.gained(s.drafts_BxK1, m_B, next_B), m_B

      reads = chain_reads(known, W_DxV, sp, u_BxU[:, k:].T)
      h_kxBxKxD, cache = apply(window_BxK, s.pos_B[:, None] + j_K, s.cache, reads)
      m_B, next_B = rule(h_kxBxKxD[0])
      out_BxK = sampling_lib.gained(s.drafts_BxK1, m_B, next_B)
      acc = gain(out_BxK, m_B, s.last_B, eos_id, budget_B)
      q_BxK1xV = _draft_dists(h_kxBxKxD, W_DxV, acc.drafts_B, sp)
      new_drafts_BxK1 = sampling_lib.draw(q_BxK1xV, u_BxU[:, k:])
      q_BxK1xV = jnp.where(active_B[:, None, None], q_BxK1xV, s.q_BxK1xV)
    else:
      def known(h1_BxKxD):
        g_BxK = jnp.argmax(sampling_lib.head_logits(h1_BxKxD, W_DxV), axis=-1).astype(jnp.int32)
        return g_BxK, accept_greedy(s.drafts_BxK1, g_BxK, s.last_B, eos_id, budget_B).drafts_B

      reads = chain_reads(known, W_DxV, None)
      h_kxBxKxD, cache = apply(window_BxK, s.pos_B[:, None] + j_K, s.cache, reads)
      pred_kxBxK = jnp.argmax(logits(params, args, h_kxBxKxD), axis=-1).astype(jnp.int32)
      acc = accept_greedy(s.drafts_BxK1, pred_kxBxK[0], s.last_B, eos_id, budget_B)
      out_BxK = pred_kxBxK[0]
      # Heads 2..k at the last accepted slot propose the next drafts.
      new_drafts_BxK1, q_BxK1xV = pred_kxBxK[1:, rows_B, acc.drafts_B].T, None
    idx_BxK = jnp.where(j_K < acc.new_B[:, None], s.n_out_B[:, None] + j_K, M)
    n_out_B = s.n_out_B + acc.new_B
    return DecodeState(
        cache=cache,
        out_BxM=s.out_BxM.at[rows_B[:, None], idx_BxK].set(out_BxK, mode="drop"),
        n_out_B=n_out_B, pos_B=s.pos_B + acc.new_B, last_B=acc.last_B,
        drafts_BxK1=jnp.where(active_B[:, None], new_drafts_BxK1, s.drafts_BxK1),
        q_BxK1xV=q_BxK1xV,
        done_B=s.done_B | (active_B & (acc.eos_B | (n_out_B >= max_new_tokens))),
        cycles_B=s.cycles_B + active_B,
        hist_K=s.hist_K + jnp.sum(jax.nn.one_hot(acc.drafts_B, k, dtype=jnp.int32)
                                  * active_B[:, None], 0),
        forwards=s.forwards + 1)

  s = jax.lax.while_loop(lambda s: ~jnp.all(s.done_B), cycle, state)
  return s.out_BxM[:, :max_new_tokens], s.n_out_B, s.cycles_B, s.hist_K, s.forwards


class Decoder:
  """Decoding with heads 1..k (k = 1: plain decoding with head 1) of `batch` prompts padded to
  `prompt_len`, for `max_new_tokens`, compiled ahead of time in the constructor
  (`compile_seconds`), so that calls time the decode alone. `sampling=True` compiles the
  sampling program (temperature, top_k, top_p and seed are then arguments of each call, and
  temperature 0 in it is greedy); False, the greedy one. Prompts are validated here, at the
  entry point."""

  def __init__(self, params, args: ModelArgs, *, k: int, batch: int, prompt_len: int,
               max_new_tokens: int, sampling: bool = False):
    check_heads(args, k)
    if max_new_tokens < 1:
      raise ValueError(f"--max_new_tokens: must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > args.max_len:
      raise ValueError(f"--max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens "
                       f"({max_new_tokens}) exceeds the model's max_len ({args.max_len})")
    self.params, self.args = slice_heads(params, args, k)
    self.batch, self.prompt_len, self.max_new_tokens = batch, prompt_len, max_new_tokens
    self.sampling = sampling
    t0 = time.perf_counter()
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    self._compiled = _decode.lower(
        self.params, i32(batch, prompt_len), i32(batch), i32(), i32(),
        sampling_lib.Params(f32, i32(), f32), i32(), args=self.args,
        max_new_tokens=max_new_tokens, sample=sampling).compile()
    self.compile_seconds = time.perf_counter() - t0

  def __call__(self, prompts: list, *, eos_id: int, pad_id: int, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> DecodeResult:
    """Decodes token-id prompts (ragged lists; `batch` of them, none longer than prompt_len).
    Row b draws its samples from (seed, b): the same prompt list and seed give the same output."""
    sampling_lib.check(temperature, top_k, top_p, seed)
    if temperature > 0 and not self.sampling:
      raise ValueError("--temperature: this Decoder was compiled for greedy decoding; build it "
                       "with sampling=True to sample")
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("prompt: every prompt needs at least one token")
    if len(prompts) != self.batch or max(len(p) for p in prompts) > self.prompt_len:
      raise ValueError(f"prompt: this Decoder takes {self.batch} prompts of at most "
                       f"{self.prompt_len} tokens")
    prompt_BxP = np.full((self.batch, self.prompt_len), pad_id, np.int32)
    for b, p in enumerate(prompts):
      prompt_BxP[b, :len(p)] = p
    lens_B = np.asarray([len(p) for p in prompts], np.int32)
    sp = sampling_lib.Params(np.float32(temperature), np.int32(top_k), np.float32(top_p))
    t0 = time.perf_counter()
    tokens, n_out, cycles, hist, forwards = jax.device_get(self._compiled(
        self.params, prompt_BxP, lens_B, np.int32(eos_id), np.int32(pad_id), sp,
        np.int32(seed)))
    return DecodeResult(tokens=np.asarray(tokens), lengths=np.asarray(n_out),
                        cycles=np.asarray(cycles), accepted_hist=np.asarray(hist),
                        forwards=int(forwards), seconds=time.perf_counter() - t0,
                        compile_seconds=self.compile_seconds)


def decode(params, args: ModelArgs, prompts: list, *, max_new_tokens: int, k: int,
           eos_id: int, pad_id: int, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0) -> DecodeResult:
  """Decodes a batch of token-id prompts (ragged lists) with heads 1..k; k = 1 is plain
  decoding with head 1. temperature 0: greedy (top_k, top_p, seed unused); > 0: sampling with
  temperature, then top_k (0 = off), then top_p (1 = off), row b seeded by (seed, b); with k > 1
  speculative sampling, distributed exactly as plain sampling. num_samples samples of a prompt:
  `repeat(prompts, num_samples)`."""
  sampling_lib.check(temperature, top_k, top_p, seed)
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompt: every prompt needs at least one token")
  decoder = Decoder(params, args, k=k, batch=len(prompts),
                    prompt_len=max(len(p) for p in prompts), max_new_tokens=max_new_tokens,
                    sampling=temperature > 0)
  return decoder(prompts, eos_id=eos_id, pad_id=pad_id, temperature=temperature, top_k=top_k,
                 top_p=top_p, seed=seed)


def greedy(params, args: ModelArgs, prompts: list, **kw) -> DecodeResult:
  """Ordinary autoregressive decoding with head 1 only: the baseline (greedy, or plain sampling
  with temperature > 0)."""
  return decode(params, args, prompts, k=1, **kw)


def repeat(prompts: list, num_samples: int) -> list:
  """Each prompt num_samples times in a row (rows i * num_samples + s, s < num_samples): the
  batch that draws num_samples independent samples of every prompt (pass@k)."""
  if not isinstance(num_samples, int) or num_samples < 1:
    raise ValueError(f"--num_samples: must be an integer >= 1, got {num_samples!r}")
  return [p for p in prompts for _ in range(num_samples)]


def forward_seconds(params, args: ModelArgs, k: int, *, batch: int, context: int,
                    reps: int = 21) -> dict[str, float]:
  """The cost model's inputs (BACKGROUND.md §5, S = a x T1 / Tk): median seconds of one cached
  forward over a 1-token window with head 1 alone (T1) and over a k-token window with heads
  1..k (Tk), at `context` tokens of cache, timed on their own outside any decoding loop. (The
  in-loop seconds per forward would make a x T1 / Tc equal the measured speed-up by
  construction.)"""
  out = {}
  for name, width in (("forward_1", 1), ("forward_k", k)):
    p, a = slice_heads(params, args, width)
    model = MTPModel(a)
    cache = init_decode_cache(a, batch, context + k + 1, dtype=a.dtype)
    toks = jnp.zeros((batch, width), jnp.int32)
    pos = context + jnp.broadcast_to(jnp.arange(width), (batch, width))
    f = jax.jit(lambda p, c, model=model, toks=toks, pos=pos: model.apply(
        {"params": p}, toks, positions_BxS=pos, cache=c, decoding=True))
    jax.block_until_ready(f(p, cache))
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      jax.block_until_ready(f(p, cache))
      times.append(time.perf_counter() - t)
    out[name] = float(np.median(times))  # the median: robust to a busy machine
  return out
