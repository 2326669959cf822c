"""Greedy decoding and greedy self-speculative decoding with the MTP heads (Gloeckle et al. 2024
§3.2 and appendix A; blockwise parallel decoding, Stern et al. 2018).

One cycle feeds [last accepted token, drafts d_1..d_{k-1}] at positions L..L+k-1 through the
trunk and heads 1..k with a KV cache. Head 1's argmax g_j at window slot j is the greedy token
for position L+j+1, so draft d_j is accepted while d_j == g_{j-1}; with m drafts accepted the
row gains g_0..g_m (m + 1 tokens) and heads 2..k at slot m propose the next drafts. Cache slots
past the new length hold rejected states; they are never read before being overwritten
(rollback by length). `greedy` is the same loop with k = 1 and only head 1's parameters, so
both are measured on the same machinery. Output equals head 1's greedy output token for token.

The whole loop is one jit: lax.while_loop, static shapes, per-row lengths; rows that hit EOS or
max_new_tokens stop (their slots are frozen) while the others go on.

Sequential (DeepSeek-V3) heads decode in chain mode: depth j reads depth j-1's argmax at the
same position, so one forward yields k-1 chained drafts at the last accepted position; depth 1
reads head 1's token and is exact, deeper depths' cache entries hold draft-based states (this
costs acceptance, never exactness).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.layers import ModelArgs
from mtp_jax.model import MTPModel, init_decode_cache, logits


def check_heads(args: ModelArgs, k: int) -> None:
  if not 1 <= k <= args.n_future:
    raise ValueError(f"--heads: must be between 1 and the model's n_future ({args.n_future}), "
                     f"got {k}")


def slice_heads(params, args: ModelArgs, k: int):
  """Params and args of the model restricted to heads 1..k (k <= n_future)."""
  check_heads(args, k)
  heads = dict(params["heads"]) if "heads" in params else {}
  take = lambda tree, n: jax.tree.map(lambda x: x[:n], tree)
  if args.head_kind == "parallel":
    heads["blocks"] = take(heads["blocks"], k)
  else:
    name = "mlps" if args.head_kind == "projection" else "depths"
    if k == 1:
      heads.pop(name, None)
    else:
      heads[name] = take(heads[name], k - 1)
  params = dict(params)
  if heads:
    params["heads"] = heads
  else:
    params.pop("heads", None)
  return params, dataclasses.replace(args, n_future=k)


@dataclasses.dataclass
class DecodeResult:
  tokens: np.ndarray  # [B, max_new_tokens] generated ids, pad after each row's length
  lengths: np.ndarray  # [B] generated tokens per row (an EOS counts and ends the row)
  cycles: np.ndarray  # [B] verification forwards each row took part in (prefill excluded)
  accepted_hist: np.ndarray  # [k] how often 0..k-1 drafts were accepted, over row-cycles
  forwards: int  # model calls: prefill + cycles
  seconds: float = 0.0  # wall time of the compiled decode (compilation excluded)
  compile_seconds: float = 0.0

  @property
  def tokens_per_forward(self) -> float:
    """a: mean tokens gained per verification forward (the first token, from prefill, aside)."""
    return float((self.lengths - 1).sum() / max(self.cycles.sum(), 1))

  def acceptance_by_position(self) -> np.ndarray:
    """P(draft j accepted), j = 1..k-1: the chance that at least j drafts pass in a cycle."""
    h = self.accepted_hist
    return np.asarray([h[j:].sum() / max(h.sum(), 1) for j in range(1, len(h))])


@functools.partial(jax.jit, static_argnames=("args", "max_new_tokens"))
def _decode(params, prompt_BxP, prompt_len_B, eos_id, pad_id, *, args: ModelArgs,
            max_new_tokens: int):
  model = MTPModel(args)
  k = args.n_future
  B, P = prompt_BxP.shape
  rows_B = jnp.arange(B)
  cache = init_decode_cache(args, B, P + max_new_tokens + k, dtype=args.dtype)
  apply = lambda toks, pos, c: model.apply({"params": params}, toks, positions_BxS=pos,
                                           cache=c, chain=True)

  # Prefill: the padded prompt at positions 0..P-1; each row reads its heads at len - 1.
  # Slots past a row's length hold pad states that the causal mask never shows it.
  h_kxBxPxD, cache = apply(prompt_BxP, jnp.broadcast_to(jnp.arange(P), (B, P)), cache)
  h_kxBxD = h_kxBxPxD[:, rows_B, prompt_len_B - 1]
  tok_kxB = jnp.argmax(logits(params, args, h_kxBxD[:, :, None])[:, :, 0], axis=-1)
  first_B = tok_kxB[0].astype(jnp.int32)
  M = max_new_tokens + k
  state = dict(
      cache=cache,
      out=jnp.full((B, M), pad_id, jnp.int32).at[:, 0].set(first_B),
      n_out=jnp.ones((B,), jnp.int32),
      pos=prompt_len_B.astype(jnp.int32),  # position of `last`, the newest token, not yet fed
      last=first_B,
      drafts=tok_kxB[1:].T.astype(jnp.int32),  # [B, k-1]
      done=(first_B == eos_id) | (max_new_tokens <= 1),
      cycles=jnp.zeros((B,), jnp.int32),
      hist=jnp.zeros((k,), jnp.int32),
      forwards=jnp.ones((), jnp.int32),
  )
  j_K = jnp.arange(k)

  def cycle(s):
    window_BxK = jnp.concatenate([s["last"][:, None], s["drafts"]], axis=1)
    h_kxBxKxD, cache = apply(window_BxK, s["pos"][:, None] + j_K, s["cache"])
    pred_kxBxK = jnp.argmax(logits(params, args, h_kxBxKxD), axis=-1).astype(jnp.int32)
    g_BxK = pred_kxBxK[0]
    match = (s["drafts"] == g_BxK[:, :k - 1]).astype(jnp.int32)
    m_B = jnp.sum(jnp.cumprod(match, axis=1), axis=1)
    n_B = m_B + 1
    eos_BxK = (g_BxK == eos_id) & (j_K < n_B[:, None])
    hit_eos_B = jnp.any(eos_BxK, axis=1)
    n_B = jnp.where(hit_eos_B, jnp.argmax(eos_BxK, axis=1) + 1, n_B)
    active_B = ~s["done"]
    n_B = jnp.where(active_B, jnp.minimum(n_B, max_new_tokens - s["n_out"]), 0)
    idx_BxK = jnp.where(j_K < n_B[:, None], s["n_out"][:, None] + j_K, M)
    out = s["out"].at[rows_B[:, None], idx_BxK].set(g_BxK, mode="drop")
    n_out = s["n_out"] + n_B
    last = jnp.where(active_B, g_BxK[rows_B, jnp.maximum(n_B - 1, 0)], s["last"])
    drafts = jnp.where(active_B[:, None], pred_kxBxK[1:, rows_B, m_B].T, s["drafts"])
    hist = s["hist"] + jnp.sum(jax.nn.one_hot(m_B, k, dtype=jnp.int32) * active_B[:, None], 0)
    return dict(
        cache=cache, out=out, n_out=n_out, pos=s["pos"] + n_B, last=last, drafts=drafts,
        done=s["done"] | (active_B & (hit_eos_B | (n_out >= max_new_tokens))),
        cycles=s["cycles"] + active_B, hist=hist, forwards=s["forwards"] + 1)

  s = jax.lax.while_loop(lambda s: ~jnp.all(s["done"]), cycle, state)
  return s["out"][:, :max_new_tokens], s["n_out"], s["cycles"], s["hist"], s["forwards"]


def decode(params, args: ModelArgs, prompts: list, *, max_new_tokens: int, k: int,
           eos_id: int, pad_id: int) -> DecodeResult:
  """Decodes a batch of token-id prompts (ragged lists) with heads 1..k; k = 1 is greedy."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompt: every prompt needs at least one token")
  if max_new_tokens < 1:
    raise ValueError(f"--max_new_tokens: must be >= 1, got {max_new_tokens}")
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > args.max_len:
    raise ValueError(f"--max_new_tokens: prompt ({longest} tokens) + max_new_tokens "
                     f"({max_new_tokens}) exceeds the model's max_len ({args.max_len})")
  params_k, args_k = slice_heads(params, args, k)
  prompt_BxP = np.full((len(prompts), longest), pad_id, np.int32)
  for b, p in enumerate(prompts):
    prompt_BxP[b, :len(p)] = p
  lens_B = np.asarray([len(p) for p in prompts], np.int32)
  ids = (np.int32(eos_id), np.int32(pad_id))
  shardings = tuple(getattr(x, "sharding", None) for x in jax.tree.leaves(params_k))
  key = (args_k, prompt_BxP.shape, max_new_tokens, shardings)
  t0 = time.perf_counter()
  if key not in _COMPILED:
    _COMPILED[key] = _decode.lower(params_k, prompt_BxP, lens_B, *ids, args=args_k,
                                   max_new_tokens=max_new_tokens).compile()
  t1 = time.perf_counter()
  tokens, n_out, cycles, hist, forwards = jax.device_get(
      _COMPILED[key](params_k, prompt_BxP, lens_B, *ids))
  t2 = time.perf_counter()
  return DecodeResult(tokens=np.asarray(tokens), lengths=np.asarray(n_out),
                      cycles=np.asarray(cycles), accepted_hist=np.asarray(hist),
                      forwards=int(forwards), seconds=t2 - t1, compile_seconds=t1 - t0)


_COMPILED: dict = {}  # (args, shapes, ...) -> compiled decode; params are arguments, not keys


def greedy(params, args: ModelArgs, prompts: list, **kw) -> DecodeResult:
  """Ordinary autoregressive decoding with head 1 only: the baseline."""
  return decode(params, args, prompts, k=1, **kw)
