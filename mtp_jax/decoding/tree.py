"""Tree drafts for self-speculative decoding (Medusa, Cai et al. 2024, §2.1.2 "tree
attention"; SpecInfer, Miao et al. 2024), verified in one forward inside the one-jit loop,
greedy or sampled; static trees (a spec) and dynamic ones (`dynamic:N`, after EAGLE-2).

A spec `c_1,...,c_D` (e.g. `4,2,1`) is a static tree: the root is the row's newest token `last`
(position L); its c_1 children are head 2's top-c_1 tokens for position L+1, each of them has
c_2 children, head 3's top-c_2 tokens for L+2, and so on to head D+1: 1 + c_1 + c_1 c_2 + ...
nodes, numbered breadth-first (a parent before its children). A chain of k heads is the spec
`1,...,1` (k-1 ones). Heads 2..D+1 drafted the candidates at the previous cycle's last accepted
node, so every node of a depth chooses among the same candidates (MTP heads read one position).

`dynamic:N` (EAGLE-2, Li et al. 2024: expand the most likely paths) keeps the window at N nodes,
so one compiled program serves every cycle, but chooses them per row and cycle: the root and
the N - 1 most likely paths by the drafting heads' joint probability, a path's being the product
of head d+1's softmax probability of its depth-d token over its depths (the heads draft their
depths independently, so this is the heads' own probability of the path). A node's score is at
most its parent's, so the N - 1 best nodes hold their ancestors (ties go to the shallower); they
are found depth by depth (the best N - 1 of depth d extend the best N - 1 of depth d - 1), then
over all depths (`draft_dynamic`), numbered by score, a parent before its children. Depths: all
the decoder's drafting heads. The tables a cycle reads are then per row (`Layout`), which a
static tree broadcasts.

One cycle feeds all N nodes at once: node n at RoPE position L + depth(n), written to cache
slot L + n, seeing the committed cache (slots < L) and its own ancestors in the window (the
tree mask, handed to attention as bits: `layers.Attention` with a cache and segment ids).
Greedy: head 1's argmax g at node n is the greedy token after the path root..n; a child is
accepted when its token equals g at its parent and its parent was accepted. Sampled
(temperature, top-k, top-p): head 1's truncated distribution p at each node, and recursive
rejection sampling over each accepted node's children (`sampling.accept_tree`: the drafts are
the heads' top candidates, not draws, and the rule for such drafts is the exact one; its
docstring says why). The deepest accepted node (m = its depth) gives the row m drafts and the
token after them (greedy: g along the path, all equal to greedy's own tokens; sampled: the
accepted drafts and a draw from the residual), cut after an EOS and to the budget
(`decode_loop.gain`). The path's KV entries (trunk and every head block with a cache) move to
slots L..L+m (compaction), so the next cycle's committed cache is exactly what plain decoding
would have written, and heads 2..k at the path's last node draft the next tree.

Head kinds whose `drafts_tree` holds (parallel and projection heads). Sequential (DeepSeek-V3)
depths draft a chain (each depth reads its predecessor's draft, one path):
`mtp_jax.decoding.decode` falls back to the chain with a logged reason.
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
from mtp_jax.decoding import sampling as sampling_lib
from mtp_jax.decoding.forward import Forward
from mtp_jax.decoding.decode_loop import DecodeState, budget, commit, gain, run, start
from mtp_jax.heads import head_logits
from mtp_jax.model import MTPModel, init_decode_cache, logits, unembedding, unrolled

MAX_NODES = 32  # the tree mask travels as int32 bits, one per window token
SPEC_FORMS = ("a comma-separated list of positive integers (children per node at each depth, "
              "e.g. 4,2,1), dynamic:N or auto")


class Tables(NamedTuple):
  """A tree's tables (numpy), one entry per node (breadth-first)."""
  parent: np.ndarray  # [N] int32 (the root is its own parent)
  depth: np.ndarray  # [N] int32
  rank: np.ndarray  # [N] int32: the node's index among its head's top candidates
  ancestors: np.ndarray  # [N, N] bool, self included
  at_depth: np.ndarray  # [N, k] int32: the node's ancestor at each depth, itself past its depth
  children: np.ndarray  # [N, max(spec)] int32: the node's children by rank, -1 past them


class Layout(NamedTuple):
  """A draft tree as a cycle reads it, per row (jax arrays): a static tree's `Tables` broadcast,
  or a dynamic tree's own (`draft_dynamic`)."""
  depth_BxN: jax.Array
  parent_BxN: jax.Array
  bits_BxN: jax.Array  # int32: bit j of node n set when n sees window token j (`Tree.bits`)
  at_depth_BxNxK: jax.Array
  children_BxNxC: jax.Array  # -1 past a node's children; siblings in the order they are tried


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
    """parent, depth, rank, ancestors, at_depth, children (`Tables`)."""
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
    children = np.full((n, max(self.spec, default=1)), -1, np.int32)
    for i in range(n):
      if i:
        children[parent[i], rank[i]] = i
      j = i
      while True:
        anc[i, j] = True
        at_depth[i, depth[j]] = j
        if j == 0:
          break
        j = parent[j]
      at_depth[i, depth[i] + 1:] = i
    return Tables(parent=np.asarray(parent, np.int32), depth=np.asarray(depth, np.int32),
                  rank=np.asarray(rank, np.int32), ancestors=anc, at_depth=at_depth,
                  children=children)

  @property
  def n_nodes(self) -> int:
    return len(self.tables.parent)

  def bits(self) -> np.ndarray:
    """[N] int32: bit j of node n set when n sees window token j (its ancestors and itself)."""
    return np.asarray([sum(1 << j for j in np.flatnonzero(row)) for row in self.tables.ancestors],
                      np.uint32).view(np.int32)

  def window(self) -> tuple[np.ndarray, np.ndarray]:
    """(depth [N], bits [N]): the window's positions past the root and its mask."""
    return self.tables.depth, self.bits()

  def layout(self, batch: int) -> Layout:
    t = self.tables
    row = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + x.shape)
    return Layout(row(t.depth), row(t.parent), row(self.bits()), row(t.at_depth),
                  row(t.children))


@dataclasses.dataclass(frozen=True)
class Dynamic:
  """`dynamic:N`: a window of `nodes` nodes, the root and the nodes - 1 most likely paths by the
  drafting heads' joint probability, chosen per row and cycle (module docstring), over `levels`
  depths (heads 2..levels + 1; None until the decoder's heads are known)."""
  nodes: int
  levels: int | None = None

  @property
  def k(self) -> int | None:
    return None if self.levels is None else self.levels + 1

  @property
  def name(self) -> str:
    return f"dynamic:{self.nodes}"

  @property
  def n_nodes(self) -> int:
    return self.nodes

  def window(self) -> tuple[np.ndarray, np.ndarray]:
    """A stand-in window of as many nodes, for timing a forward (the root and nodes - 1
    children): a dynamic window's cost does not depend on its shape."""
    return Tree((self.nodes - 1,)).window()


def is_tree(tree) -> bool:
  """A tree the tree loop decodes: dynamic, or static with some depth wider than one (a chain
  spec goes to the chain loop)."""
  return isinstance(tree, Dynamic) or (isinstance(tree, Tree) and max(tree.spec, default=1) > 1)


def by_depth(hist_N, tree, k: int) -> np.ndarray:
  """Cycles counted by the deepest accepted node of a static `tree` -> by drafts accepted (that
  node's depth), [k]; a chain's or a dynamic tree's counts (tree None or Dynamic) are so already."""
  if isinstance(tree, Tree):
    return np.bincount(tree.tables.depth, weights=hist_N, minlength=k).astype(np.int64)
  return np.asarray(hist_N)


def _parse_dynamic(spec: str, n_future: int | None) -> Dynamic:
  _, _, n = spec.partition(":")
  if not (n.isdigit() and 2 <= int(n) <= MAX_NODES):
    raise ValueError(f"tree: dynamic:N takes N, the window's nodes (the root and N - 1 drafted "
                     f"paths), an integer 2..{MAX_NODES}, got {spec!r}")
  if n_future is not None and n_future < 2:
    raise ValueError(f"tree: {spec} drafts with heads 2.., but the model has {n_future} head")
  return Dynamic(int(n), None if n_future is None else n_future - 1)


def parse(spec, n_future: int | None = None) -> Tree | Dynamic:
  """`4,2,1` (or a tuple) -> Tree, `dynamic:N` -> Dynamic (over n_future - 1 depths), or one
  ValueError naming the parameter (tree)."""
  if isinstance(spec, (Tree, Dynamic)):
    tree = spec
  elif isinstance(spec, str) and spec.startswith("dynamic"):
    return _parse_dynamic(spec, n_future)
  else:
    try:
      parts = tuple(int(x) for x in (spec.split(",") if isinstance(spec, str) else spec))
    except (TypeError, ValueError):
      raise ValueError(f"tree: {SPEC_FORMS}, got {spec!r}") from None
    if not parts or min(parts) < 1:
      raise ValueError(f"tree: {SPEC_FORMS}, got {spec!r}")
    tree = Tree(parts)
  if isinstance(tree, Dynamic):
    return tree
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


def draft_dynamic(lg_DxBxV, root_B, nodes: int) -> tuple[jax.Array, Layout]:
  """([B, N] node tokens, their `Layout`): the root and the N - 1 most likely paths by the
  drafting heads' joint probability (module docstring), numbered by score (a parent before its
  children; siblings most likely first)."""
  D, B, V = lg_DxBxV.shape
  N, C = nodes, min(nodes - 1, V)
  rows_B = jnp.arange(B)
  # each head's C best as log-probabilities, head by head: XLA:CPU makes a top_k a TopK call
  # only where its sort is sliced along the sorted axis alone; one top_k over [D, B, V] indexed
  # by depth below stayed a full sort of the vocabulary (35 ms a cycle on SmolLM2)
  lg_DxBxV = jax.nn.log_softmax(lg_DxBxV.astype(jnp.float32))
  best = [jax.lax.top_k(lg_DxBxV[d], C) for d in range(D)]
  # Candidates, depth by depth (global index: the root 0, then each depth's best in a block):
  # the best min(N - 1, F C) children of the previous depth's F best hold that depth's best.
  score, parent, tok, depth = [jnp.full((B, 1), jnp.inf)], [jnp.zeros((B, 1), jnp.int32)], \
      [root_B[:, None].astype(jnp.int32)], [0]
  front_BxF, start = jnp.zeros((B, 1), jnp.float32), 0
  for d in range(D):
    F = front_BxF.shape[1]
    s_BxFC = (front_BxF[:, :, None] + best[d][0][:, None, :]).reshape(B, F * C)
    front_BxF, idx_BxF = jax.lax.top_k(s_BxFC, min(N - 1, F * C))
    score.append(front_BxF)
    parent.append((start + idx_BxF // C).astype(jnp.int32))
    tok.append(best[d][1][rows_B[:, None], idx_BxF % C].astype(jnp.int32))
    depth += [d + 1] * front_BxF.shape[1]
    start += F
  # The best N over all depths (the root first: score inf); a stable sort puts the shallower of
  # equal scores first, so an ancestor always precedes its descendants.
  sel_BxN = jnp.argsort(-jnp.concatenate(score, axis=1), axis=1, stable=True)[:, :N]
  node_BxM = jnp.zeros((B, len(depth)), jnp.int32).at[rows_B[:, None], sel_BxN].set(
      jnp.arange(N, dtype=jnp.int32))
  parent_BxN = jnp.take_along_axis(
      node_BxM, jnp.take_along_axis(jnp.concatenate(parent, axis=1), sel_BxN, axis=1), axis=1)
  tokens_BxN = jnp.take_along_axis(jnp.concatenate(tok, axis=1), sel_BxN, axis=1)
  depth_BxN = jnp.asarray(depth, jnp.int32)[sel_BxN]
  # Ancestors: i steps up from node n sits at depth depth(n) - i.
  a_BxN = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
  at_BxNxK = jnp.broadcast_to(a_BxN[..., None], (B, N, D + 1))
  bits_BxN = jnp.zeros((B, N), jnp.uint32)
  for i in range(D + 1):
    up_BxN = depth_BxN - i
    at_BxNxK = jnp.where(jax.nn.one_hot(up_BxN, D + 1, dtype=bool), a_BxN[..., None], at_BxNxK)
    bits_BxN = bits_BxN | jnp.where(up_BxN >= 0, jnp.left_shift(jnp.uint32(1),
                                                                a_BxN.astype(jnp.uint32)), 0)
    a_BxN = jnp.take_along_axis(parent_BxN, a_BxN, axis=1)
  m_N = jnp.arange(N)
  is_child_BxNxN = (parent_BxN[:, None, :] == m_N[:, None]) & (m_N > 0)  # [b, n, m]: n -> m
  kids_BxNxC = jnp.sort(jnp.where(is_child_BxNxN, m_N, N), axis=-1)[:, :, :C]
  layout = Layout(depth_BxN, parent_BxN, jax.lax.bitcast_convert_type(bits_BxN, jnp.int32),
                  at_BxNxK, jnp.where(kids_BxNxC == N, -1, kids_BxNxC).astype(jnp.int32))
  return tokens_BxN, layout


def accept_greedy_tree(toks_BxN, g_BxN, t: Layout):
  """The deepest node whose path is greedy's [B]: a node is accepted when its token equals head
  1's argmax g at its parent and every ancestor is accepted."""
  N = toks_BxN.shape[1]
  match_BxN = (toks_BxN == jnp.take_along_axis(g_BxN, t.parent_BxN, axis=1)) | (jnp.arange(N) == 0)
  anc_BxNxN = (jnp.right_shift(t.bits_BxN[:, :, None], jnp.arange(N)) & 1) > 0
  ok_BxN = jnp.all(match_BxN[:, None, :] | ~anc_BxNxN, axis=-1)  # every ancestor ok
  return jnp.argmax(jnp.where(ok_BxN, t.depth_BxN, -1), axis=-1)


def compact(cache, base_B, path_BxM):
  """Moves the KV entries of window slots base + path[:, j] to base + j, in every cache leaf
  ([blocks, B, K, L, E]); path[:, j] >= j, so reading all before writing is safe."""
  rows_Bx1 = jnp.arange(base_B.shape[0])[:, None]
  src_BxM = base_B[:, None] + path_BxM
  dst_BxM = base_B[:, None] + jnp.arange(path_BxM.shape[1])

  def move(c):
    return c.at[:, rows_Bx1, :, dst_BxM].set(c[:, rows_Bx1, :, src_BxM])
  return jax.tree.map(move, cache)


@functools.partial(jax.jit, static_argnames=("args", "max_new_tokens", "tree", "sample"))
def decode_tree(params, prompt_BxP, prompt_len_B, eos_id, pad_id, sp, seed, max_cycles, *,
                args: ModelArgs, max_new_tokens: int, tree: Tree | Dynamic, sample: bool):
  """Tree decoding, greedy or (sample) sampled with `sp` and `seed` as `decode_loop.decode_chain`
  takes them; returns what decode_chain returns, the histogram per row by deepest accepted node
  [B, N] (a dynamic tree: by its depth, [B, k])."""
  params, args = unrolled(params, args)  # the layers' weights sliced once, not per cycle
  k, N = args.n_future, tree.n_nodes
  dynamic = isinstance(tree, Dynamic)
  B, P = prompt_BxP.shape
  rows_B = jnp.arange(B)
  W_DxV = unembedding(params, args)[:, :args.vocab_size]
  static = None if dynamic else tree.layout(B)
  keys_B = sampling_lib.row_keys(seed, B) if sample else None
  cache = init_decode_cache(args, B, P + max_new_tokens + N, dtype=args.dtype)
  fwd = Forward(MTPModel(args), params)

  def apply(toks, pos, c, seg, accepted):  # heads 2..k read at accepted(h1)'s slot alone
    h1_BxSxD, z_BxSxD, c = fwd.first(toks, pos, c, seg)
    slot_B, after = accepted(h1_BxSxD)
    h_K1xBxSxD, c = fwd.rest(toks, pos, c, z_BxSxD, heads.Drafting(slot_B=slot_B), seg)
    return h1_BxSxD, h_K1xBxSxD, slot_B, after, c

  def next_tree(h_K1xBxD, root_B):  # (node tokens, a dynamic tree's layout or None)
    lg_K1xBxV = logits(params, args, h_K1xBxD[:, :, None])[:, :, 0]
    if dynamic:
      return draft_dynamic(lg_K1xBxV, root_B, N)
    return _draft(lg_K1xBxV, root_B, tree), None

  last_P_B = prompt_len_B - 1
  h1_BxPxD, h_K1xBxPxD, _, _, cache = apply(
      prompt_BxP, jnp.broadcast_to(jnp.arange(P), (B, P)), cache, None, lambda _: (last_P_B, None))
  lg1_BxV = logits(params, args, h1_BxPxD[rows_B, last_P_B][None, :, None])[0, :, 0]
  if sample:
    u_B = sampling_lib.uniforms(keys_B, last_P_B, 1)[:, 0]
    first_B = sampling_lib.draw(sampling_lib.probs(lg1_BxV, sp), u_B)
  else:
    first_B = jnp.argmax(lg1_BxV, axis=-1).astype(jnp.int32)
  toks_BxN, layout = next_tree(h_K1xBxPxD[:, rows_B, last_P_B], first_B)
  state = start(cache, first_B, toks_BxN, None, prompt_len_B, pad_id=pad_id, eos_id=eos_id,
                max_new_tokens=max_new_tokens, k=k, hist=k if dynamic else N, layout=layout)

  def cycle(s: DecodeState) -> DecodeState:
    budget_B = budget(s, max_new_tokens)
    toks_BxN = s.drafts_BxK1  # the tree, its root (slot 0) the row's newest token
    t = static if s.layout is None else s.layout

    def accept(h1_BxNxD):  # (deepest accepted node, after: the draw after it; greedy: g_BxN)
      lg1_BxNxV = head_logits(h1_BxNxD, W_DxV)
      if sample:
        C = t.children_BxNxC.shape[2]
        u_BxU = sampling_lib.uniforms(keys_B, s.pos_B, (k - 1) * C + 1)
        return sampling_lib.accept_tree(
            toks_BxN, sampling_lib.probs(lg1_BxNxV, sp), t.children_BxNxC, u_BxU)
      g_BxN = jnp.argmax(lg1_BxNxV, axis=-1).astype(jnp.int32)
      return accept_greedy_tree(toks_BxN, g_BxN, t), g_BxN

    _, h_K1xBxNxD, best_B, after, cache = apply(
        toks_BxN, s.pos_B[:, None] + t.depth_BxN, s.cache, t.bits_BxN, accept)
    path_BxK = t.at_depth_BxNxK[rows_B, best_B]
    m_B = t.depth_BxN[rows_B, best_B]
    if sample:  # the accepted drafts, then the draw after them
      out_BxK = sampling_lib.cycle_tokens(
          jnp.take_along_axis(toks_BxN, path_BxK[:, 1:], axis=1), m_B, after)
    else:  # greedy's tokens along the path
      out_BxK = jnp.take_along_axis(after, path_BxK, axis=1)
    acc = gain(out_BxK, m_B, s.last_B, eos_id, budget_B)
    cache = compact(cache, s.pos_B, path_BxK)
    new_toks_BxN, layout = next_tree(h_K1xBxNxD[:, rows_B, best_B], acc.last_B)
    return commit(s, acc, out_BxK, cache, new_toks_BxN, m_B if dynamic else best_B,
                  max_new_tokens=max_new_tokens, layout=layout)

  return run(cycle, state, max_cycles, max_new_tokens)
