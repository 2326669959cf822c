"""Tree drafts for greedy self-speculative decoding (Medusa, Cai et al. 2024, §2.1.2 "tree
attention"; SpecInfer, Miao et al. 2024), verified in one forward inside the one-jit loop.

A spec `c_1,...,c_D` (e.g. `4,2,1`) is a static tree: the root is the row's newest token `last`
(position L); its c_1 children are head 2's top-c_1 tokens for position L+1, each of them has
c_2 children, head 3's top-c_2 tokens for L+2, and so on to head D+1: 1 + c_1 + c_1 c_2 + ...
nodes, numbered breadth-first (a parent before its children). A chain of k heads is the spec
`1,...,1` (k-1 ones). Heads 2..D+1 drafted the candidates at the previous cycle's last accepted
node, so every node of a depth chooses among the same candidates (MTP heads read one position).

One cycle feeds all N nodes at once: node n at RoPE position L + depth(n), written to cache
slot L + n, seeing the committed cache (slots < L) and its own ancestors in the window (the
tree mask, handed to attention as bits: `layers.Attention` with a cache and segment ids).
Head 1's argmax g at node n is the greedy token after the path root..n; a child is accepted
when its token equals g at its parent and its parent was accepted. The deepest accepted node
(m = its depth) gives the row g along its path (m drafts, all equal to greedy's own tokens, and
the bonus token), cut after an EOS and to the budget (`decode_loop.gain`). The path's KV
entries (trunk and every head block with a cache) move to slots L..L+m (compaction), so the
next cycle's committed cache is exactly what plain decoding would have written, and heads 2..k
at the path's last node draft the next tree.

Greedy only, head kinds whose `drafts_tree` holds (parallel and projection heads). Sequential
(DeepSeek-V3) depths draft a chain (each depth reads its predecessor's draft, one path);
sampling uses the chain (a lossless multi-draft rule is not implemented):
`mtp_jax.decoding.decode` falls back with a logged reason.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import heads
from mtp_jax.model_args import ModelArgs
from mtp_jax.decoding.decode_loop import DecodeState, budget, commit, gain, run, start
from mtp_jax.heads import head_logits
from mtp_jax.model import MTPModel, init_decode_cache, logits, unembedding, unrolled

MAX_NODES = 32  # the tree mask travels as int32 bits, one per window token


class Tables(NamedTuple):
  """A tree's tables (numpy), one entry per node (breadth-first)."""
  parent: np.ndarray  # [N] int32 (the root is its own parent)
  depth: np.ndarray  # [N] int32
  rank: np.ndarray  # [N] int32: the node's index among its head's top candidates
  ancestors: np.ndarray  # [N, N] bool, self included
  at_depth: np.ndarray  # [N, k] int32: the node's ancestor at each depth, itself past its depth


@dataclasses.dataclass(frozen=True)
class Tree:
  """A static draft tree: children per node at each depth, and its tables (numpy)."""
  spec: tuple[int, ...]

  @property
  def k(self) -> int:
    """Heads the tree uses: 1 (verification) + one per depth."""
    return len(self.spec) + 1

  @property
  def name(self) -> str:
    return ",".join(map(str, self.spec))

  @functools.cached_property
  def tables(self) -> Tables:
    """parent, depth, rank, ancestors, at_depth (`Tables`)."""
    parent, depth, rank = [0], [0], [0]
    frontier = [0]
    for d, c in enumerate(self.spec, start=1):
      nxt = []
      for p in frontier:
        for r in range(c):
          parent.append(p)
          depth.append(d)
          rank.append(r)
          nxt.append(len(parent) - 1)
      frontier = nxt
    n = len(parent)
    anc = np.zeros((n, n), bool)
    at_depth = np.zeros((n, self.k), np.int32)
    for i in range(n):
      j = i
      while True:
        anc[i, j] = True
        at_depth[i, depth[j]] = j
        if j == 0:
          break
        j = parent[j]
      at_depth[i, depth[i] + 1:] = i
    return Tables(parent=np.asarray(parent, np.int32), depth=np.asarray(depth, np.int32),
                  rank=np.asarray(rank, np.int32), ancestors=anc, at_depth=at_depth)

  @property
  def n_nodes(self) -> int:
    return len(self.tables.parent)

  def bits(self) -> np.ndarray:
    """[N] int32: bit j of node n set when n sees window token j (its ancestors and itself)."""
    return np.asarray([sum(1 << j for j in np.flatnonzero(row)) for row in self.tables.ancestors],
                      np.uint32).view(np.int32)


def parse(spec, n_future: int | None = None) -> Tree:
  """`4,2,1` (or a tuple) -> Tree, or one ValueError naming the parameter (tree)."""
  if isinstance(spec, Tree):
    tree = spec
  else:
    try:
      parts = tuple(int(x) for x in (spec.split(",") if isinstance(spec, str) else spec))
    except (TypeError, ValueError):
      raise ValueError(f"tree: a comma-separated list of positive integers (children per "
                       f"node at each depth, e.g. 4,2,1) or auto, got {spec!r}") from None
    if not parts or min(parts) < 1:
      raise ValueError(f"tree: a comma-separated list of positive integers (children per "
                       f"node at each depth, e.g. 4,2,1) or auto, got {spec!r}")
    tree = Tree(parts)
  if tree.n_nodes > MAX_NODES:
    raise ValueError(f"tree: {tree.name} has {tree.n_nodes} nodes; at most {MAX_NODES}")
  if n_future is not None and tree.k > n_future:
    raise ValueError(f"tree: {tree.name} has {len(tree.spec)} levels, drafted by heads "
                     f"2..{tree.k}, but the model has {n_future} heads")
  return tree


def unsupported_reason(args: ModelArgs) -> str | None:
  """Why `args`' head kind cannot draft trees, or None when it can."""
  if not heads.KINDS[args.head_kind].drafts_tree:
    return (f"{args.head_kind} heads draft a chain (each depth reads its predecessor's draft), "
            "not a tree")
  return None


def _draft(lg_KxBxV, root_B, tree: Tree):
  """[B, N] node tokens: the root, then head d+1's rank-r candidate at each depth-d node."""
  depth, rank = tree.tables.depth, tree.tables.rank
  c = max(tree.spec)
  cand_KxBxC = jax.lax.top_k(lg_KxBxV, c)[1].astype(jnp.int32)
  cand_BxX = jnp.transpose(cand_KxBxC, (1, 0, 2)).reshape(root_B.shape[0], -1)
  idx_N = np.where(depth > 0, 1 + (depth - 1) * c + rank, 0)
  return jnp.concatenate([root_B[:, None], cand_BxX], axis=1)[:, idx_N]


def compact(cache, base_B, path_BxM):
  """Moves the KV entries of window slots base + path[:, j] to base + j, in every cache leaf
  ([blocks, B, K, L, E]); path[:, j] >= j, so reading all before writing is safe."""
  rows_Bx1 = jnp.arange(base_B.shape[0])[:, None]
  src_BxM = base_B[:, None] + path_BxM
  dst_BxM = base_B[:, None] + jnp.arange(path_BxM.shape[1])

  def move(c):
    return c.at[:, rows_Bx1, :, dst_BxM].set(c[:, rows_Bx1, :, src_BxM])
  return jax.tree.map(move, cache)


@functools.partial(jax.jit, static_argnames=("args", "max_new_tokens", "tree"))
def decode_tree(params, prompt_BxP, prompt_len_B, eos_id, pad_id, max_cycles, *,
                args: ModelArgs, max_new_tokens: int, tree: Tree):
  """Greedy decoding with tree drafts; returns what `decode_loop.decode_chain` returns, the
  histogram per row by deepest accepted node [B, N]."""
  params, args = unrolled(params, args)  # the layers' weights sliced once, not per cycle
  model = MTPModel(args)
  k, N = args.n_future, tree.n_nodes
  t = tree.tables
  B, P = prompt_BxP.shape
  rows_B = jnp.arange(B)
  W_DxV = unembedding(params, args)[:, :args.vocab_size]
  bits_BxN = jnp.broadcast_to(jnp.asarray(tree.bits()), (B, N))
  cache = init_decode_cache(args, B, P + max_new_tokens + N, dtype=args.dtype)
  apply = lambda toks, pos, c, seg: model.apply(
      {"params": params}, toks, seg, positions_BxS=pos, cache=c, decoding=True)

  def next_tree(h_kxBxD, root_B):
    lg_kxBxV = logits(params, args, h_kxBxD[:, :, None])[:, :, 0]
    return _draft(lg_kxBxV[1:], root_B, tree)

  last_P_B = prompt_len_B - 1
  h_kxBxPxD, cache = apply(prompt_BxP, jnp.broadcast_to(jnp.arange(P), (B, P)), cache, None)
  h_kxBxD = h_kxBxPxD[:, rows_B, last_P_B]
  first_B = jnp.argmax(logits(params, args, h_kxBxD[:1, :, None])[0, :, 0],
                       axis=-1).astype(jnp.int32)
  state = start(cache, first_B, next_tree(h_kxBxD, first_B), None, prompt_len_B, pad_id=pad_id,
                eos_id=eos_id, max_new_tokens=max_new_tokens, k=k, hist=N)

  def cycle(s: DecodeState) -> DecodeState:
    budget_B = budget(s, max_new_tokens)
    toks_BxN = s.drafts_BxK1  # the tree, its root (slot 0) the row's newest token
    h_kxBxNxD, cache = apply(toks_BxN, s.pos_B[:, None] + t.depth, s.cache, bits_BxN)
    g_BxN = jnp.argmax(head_logits(h_kxBxNxD[0], W_DxV), axis=-1).astype(jnp.int32)
    match_BxN = (toks_BxN == g_BxN[:, t.parent]) | (jnp.arange(N) == 0)
    ok_BxN = jnp.all(match_BxN[:, None, :] | ~t.ancestors[None], axis=-1)  # every ancestor ok
    best_B = jnp.argmax(jnp.where(ok_BxN, t.depth, -1), axis=-1)  # the deepest accepted node
    path_BxK = jnp.asarray(t.at_depth)[best_B]
    m_B = jnp.asarray(t.depth)[best_B]
    out_BxK = jnp.take_along_axis(g_BxN, path_BxK, axis=1)
    acc = gain(out_BxK, m_B, s.last_B, eos_id, budget_B)
    cache = compact(cache, s.pos_B, path_BxK)
    new_tree_BxN = next_tree(h_kxBxNxD[:, rows_B, best_B], acc.last_B)
    return commit(s, acc, out_BxK, cache, new_tree_BxN, best_B, max_new_tokens=max_new_tokens)

  return run(cycle, state, max_cycles, max_new_tokens)
