"""Stop sequences inside the decode loop: a row finishes once the cut `code_tasks.truncate` would
make is decided, so HumanEval / MBPP decode only what they keep.

Matching runs on the UTF-8 bytes of the generated text, one token's bytes at a time, through an
Aho-Corasick automaton of the stop strings (`build`, NumPy, once per tokenizer and stop set);
`feed` and `finished` are pure jnp functions of per-row state that the one-jit loop carries.

Exactness. `truncate(text, stops)` cuts at c = the smallest start of any stop's first occurrence
in the full text. After a prefix of the text, let c' be the smallest start of an occurrence
complete within the prefix, and a the start of the earliest partial occurrence still open at its
end (the prefix's longest suffix that is a proper prefix of some stop; the automaton's depth).
Once c' exists and a >= c', no occurrence starting before c' can ever complete, so c = c' whatever
follows: the row is finished, and truncating its (shorter) text gives exactly the cut of the full
one. With stops like "abcd" and "bc", "abc" is not finished (an "abcd" at 0 may still come).

Bytes equal text for the byte tokenizer (ids 0-255 are bytes, specials decode to nothing) and
for ASCII stop strings (an ASCII byte always decodes to itself, even next to invalid UTF-8), so
`token_bytes` covers the byte tokenizer and `build` refuses non-ASCII stops; other tokenizers
keep the cut after decoding only (`token_bytes` returns None).
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NONE = np.iinfo(np.int32).max  # no stop seen yet


class Matcher(NamedTuple):
  """The automaton and the token -> bytes table, as arrays (a pytree the jit takes)."""
  goto_NxA: np.ndarray  # [nodes, 256] next node after a byte (failure links folded in)
  depth_N: np.ndarray  # length of the stop prefix a node stands for
  match_N: np.ndarray  # longest stop ending at this node (0: none)
  bytes_VxL: np.ndarray  # [vocab, L] each token's bytes (-1 beyond its length)
  nbytes_V: np.ndarray  # bytes per token (0: a special token)


class StopState(NamedTuple):
  node_B: jax.Array  # automaton node after the row's text so far
  len_B: jax.Array  # bytes of the row's text so far
  cut_B: jax.Array  # smallest start of a complete stop occurrence (NONE: none yet)


def token_bytes(tokenizer, vocab_size: int):
  """(bytes_VxL, nbytes_V) for a tokenizer whose decoding is the concatenation of its tokens'
  bytes (the byte tokenizer); None for others."""
  if type(tokenizer).__name__ != "ByteTokenizer":
    return None
  n = np.zeros(vocab_size, np.int32)
  b = np.full((vocab_size, 1), -1, np.int32)
  n[:256], b[:256, 0] = 1, np.arange(256)
  return b, n


def build(stops, bytes_VxL: np.ndarray, nbytes_V: np.ndarray) -> Matcher:
  """The Aho-Corasick automaton (Aho and Corasick 1975) of `stops` over bytes."""
  pats = []
  for s in stops:
    if not s or not s.isascii():
      raise ValueError(f"stops: in-loop stop sequences must be non-empty ASCII, got {s!r}")
    pats.append(s.encode())
  children, depth, match = [{}], [0], [0]
  for p in pats:  # the trie
    node = 0
    for ch in p:
      if ch not in children[node]:
        children.append({})
        depth.append(depth[node] + 1)
        match.append(0)
        children[node][ch] = len(children) - 1
      node = children[node][ch]
    match[node] = max(match[node], len(p))
  goto = np.zeros((len(children), 256), np.int32)
  fail = [0] * len(children)
  queue = collections.deque()
  for ch, nxt in children[0].items():
    goto[0, ch] = nxt
    queue.append(nxt)
  while queue:  # breadth first: a node's failure link is settled before its children's
    node = queue.popleft()
    match[node] = max(match[node], match[fail[node]])  # stops that end here as suffixes
    goto[node] = goto[fail[node]]
    for ch, nxt in children[node].items():
      fail[nxt] = goto[fail[node], ch] if node else 0
      goto[node, ch] = nxt
      queue.append(nxt)
  return Matcher(goto, np.asarray(depth, np.int32), np.asarray(match, np.int32),
                 np.asarray(bytes_VxL, np.int32), np.asarray(nbytes_V, np.int32))


def init(batch: int) -> StopState:
  z = jnp.zeros((batch,), jnp.int32)
  return StopState(z, z, jnp.full((batch,), NONE, jnp.int32))


def feed(m: Matcher, st: StopState, tokens_BxK, n_B) -> StopState:
  """The rows' state after their next tokens tokens_BxK[:, :n_B] (n_B = 0: unchanged)."""
  m = Matcher(*map(jnp.asarray, m))
  K, L = tokens_BxK.shape[1], m.bytes_VxL.shape[1]

  def step(i, st):
    j, l = i // L, i % L
    tok_B = tokens_BxK[:, j]
    byte_B = m.bytes_VxL[tok_B, l]
    live_B = (j < n_B) & (l < m.nbytes_V[tok_B])
    node_B = jnp.where(live_B, m.goto_NxA[st.node_B, jnp.maximum(byte_B, 0)], st.node_B)
    len_B = st.len_B + live_B
    hit_B = live_B & (m.match_N[node_B] > 0)
    cut_B = jnp.where(hit_B, jnp.minimum(st.cut_B, len_B - m.match_N[node_B]), st.cut_B)
    return StopState(node_B, len_B, cut_B)

  return jax.lax.fori_loop(0, K * L, step, st)


def finished(m: Matcher, st: StopState):
  """[B] bool: the row's cut is decided (a stop is complete and no earlier one is open)."""
  return (st.cut_B != NONE) & (st.len_B - jnp.asarray(m.depth_N)[st.node_B] >= st.cut_B)
