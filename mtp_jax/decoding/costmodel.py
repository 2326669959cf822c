"""The cost model of self-speculative decoding, and the choice it makes (`heads="auto"`,
`tree="auto"` in `mtp_jax.decoding.decode`).

Speculation with k heads (or a tree of N nodes) pays when S = a x T1 / Tk > 1: a the tokens a
row gains per verification forward, T1 a one-token forward with head 1 alone (plain decoding),
Tk a k-token (N-token) forward with heads 1..k, both timed on their own with the call's batch
and context (`forward_seconds`; a `decode.Session` keeps them per shape). A batch runs until its
slowest row is done, so the a that counts is the slowest row's.

Acceptance comes from a probe: the whole call decoded with the largest candidate (the chain of
all heads, or the union of the candidate trees) on the call's own prompts, recording for every
row which node was the deepest accepted one in each cycle (for a chain: how many drafts passed, the
per-depth conditional acceptance P(d_j | d_{j-1}) in histogram form). Every candidate is a
sub-tree of the probe (a chain of k' heads: the first k'-1 depths, one candidate each; a tree
c'_1,..,c'_D with c'_d <= c_d), and in greedy decoding the accepted path is the greedy
continuation, so on each probed cycle the depth a candidate would have reached follows from
the probe's best node alone: the first depth whose token ranked beyond the candidate's width
(`reached_depth`). Per row,
that gives a(candidate) = 1 + E[depth reached], smoothed toward the batch's pooled histogram
(PRIOR pseudo-cycles: a row probed for few cycles is not trusted alone). A batch runs until its
slowest row is done, so the batch's a is N / E[max over rows of the cycles a row needs for
N = max_new_tokens tokens], each row's cycles from a predictive distribution that holds the
decode's own spread and the probe's error in the row's mean (`predict_a`): one rule, each risk
counted once, no z on top (docs/decoding.md, "One pessimism rule").
(Sampled chains: the histogram of accepted drafts, read the same way; exact for greedy, an
estimate for sampling.) The loop's own cost beyond the forward (acceptance, drafting, stops) is
measured on the probe for the candidates and on a plain decoding loop for plain decoding
(`decode.Session`), so both sides of S carry their loop; the same probes give each call's
fixed part (prefill, the call), and the S compared is the call's (`call_speedup`). The choice
is the candidate of highest predicted S, plain decoding (S = 1) unless a candidate beats it by
MIN_GAIN; a pick other than the probe's window is probed on its own loop and chosen again
before auto bets on it, and a pick read from one own-loop probe is probed there again and
chosen on the two probes' mean; a bet's S is reported from one more probe that the choice does
not use (`session.Session`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

from mtp_jax import heads
from mtp_jax.model_args import ModelArgs
from mtp_jax.model import MTPModel, init_decode_cache, unembedding, unrolled
from mtp_jax.decoding.forward import Forward
from mtp_jax.decoding.tree import Tree, is_tree, parse

PRIOR = 4.0  # pseudo-cycles of the pooled histogram added to each row's
MIN_GAIN = 1.05  # a candidate must beat plain decoding by this much predicted S
BOUND_SLACK = 0.9  # `bounds` takes a window at 0.9x the floor's time: timings of one program
# differ by up to about 10% on a loaded machine, and a bound must not prune by noise
DYNAMIC_A_HEADROOM = 1.3  # tree=auto's dynamic tree of N nodes accepts at most this much more
# than the static tree of N nodes: in every grid of experiments/results the dynamic's predicted a
# was at most 1.26x the static's (1.61 against 1.28)
TREE_CANDIDATES = ("2", "3", "4", "2,1", "3,1", "4,1", "2,2", "2,1,1", "3,1,1", "4,1,1",
                   "2,2,1", "3,2,1", "4,2,1", "4,2,2")
PROBE_CYCLES = 4  # cycles of a speculative window's short timed run (`probe_lengths`)
PLAIN_PROBE_STEPS = 12  # plain decoding's steps in its short timed run (`probe_lengths`)


LOOP_COUNTS = (2, 10)  # forwards per timed call: the per-forward cost is the difference / 8


def forward_times(params, args: ModelArgs, trees: list[Tree], *, batch: int, context: int,
                  reps: int = 11) -> dict[Tree, float]:
  """Seconds of one cached forward of each window (a chain of k heads: k tokens, heads 1..k;
  a tree: its nodes with its mask, heads 1..tree.k) at `context` tokens of cache, as a decoding
  loop runs it: inside a compiled loop (the cache updated in place, the trunk unrolled, head 1's
  argmax at every window token and the drafting heads' at one), but without the loop's own
  bookkeeping (acceptance, drafting, stops: timing the decode cycle itself would make a x T1 / Tc
  equal the measured speed-up by construction). A call runs the forward n times; the time per
  forward is (t(10) - t(2)) / 8, so call overhead and the cache's copy into the loop cancel.
  (Timed as one jitted call each, a one-token forward cost far more than a plain decoding step,
  and the predictions were wrong: docs/cpu_speed.md.)
  Each window compiled and warmed up, then `reps` rounds calling every window at both counts;
  a window's time is the median over rounds of t(10) - t(2) within a round (paired: the two calls
  see the same moment's load), and a window that holds another (`holds`) never times cheaper
  than it. (The difference of the two minima, on a 2-core VM at 0.5-5 ms a forward, put a 2-token
  window at the 1-token one's time and a 4-token one at twice its own loop's cycle:
  docs/decoding.md, "Where auto bets".) Measured on every call (`decode.Session.forward_times`
  keeps them per shape)."""
  trees = list(dict.fromkeys(trees))
  fns = [_forward_fn(params, args, t, batch, context) for t in trees]
  lo, hi = LOOP_COUNTS
  per = [[] for _ in trees]
  for _ in range(reps):
    for f, ds in zip(fns, per):
      t0 = time.perf_counter()
      f(lo)
      t1 = time.perf_counter()
      f(hi)
      ds.append((time.perf_counter() - t1) - (t1 - t0))
  return monotone({t: max(float(np.median(ds)) / (hi - lo), 1e-9) for t, ds in zip(trees, per)})


def holds(big, small) -> bool:
  """Whether `big`'s window holds `small`'s: as many depths or more, at least as many nodes at
  each (the chain of 1 is held by every window): its forward does at least `small`'s work. A
  dynamic tree's window (its shape chosen per cycle) by its node count and heads."""
  if isinstance(big, Tree) and isinstance(small, Tree):
    return (len(small.spec) <= len(big.spec)
            and all(s <= b for s, b in zip(small.spec, big.spec)))
  return small.n_nodes <= big.n_nodes and (None in (big.k, small.k) or small.k <= big.k)


def monotone(times: dict[Tree, float]) -> dict[Tree, float]:
  """`times` with every window's time at least that of each window it holds (`holds`): a timing
  below a smaller window's is noise, and the smaller one's time the least the larger costs."""
  return {t: max(s for u, s in times.items() if holds(t, u)) for t in times}


def forward_seconds(params, args: ModelArgs, k: int, *, batch: int, context: int,
                    reps: int = 21, tree: Tree | None = None) -> dict[str, float]:
  """The cost model's inputs (`forward_times`, interleaved): a 1-token window with head 1 alone
  (T1, "forward_1") and a k-token window with heads 1..k (Tk, "forward_k"), or `tree`'s."""
  window = chain(k) if tree is None else tree
  t = forward_times(params, args, [chain(1), window], batch=batch, context=context, reps=reps)
  return {"forward_1": t[chain(1)], "forward_k": t[window]}


def _forward_fn(params, args, tree: Tree, batch, context):
  """n -> runs `tree`'s cached forward n times in one compiled loop and waits for it."""
  f, p, cache = forward_program(params, args, tree, batch, context)
  jax.block_until_ready(f(p, cache, LOOP_COUNTS[-1]))
  return lambda n: jax.block_until_ready(f(p, cache, n))


def forward_program(params, args, tree: Tree, batch, context):
  """(jitted (params, cache, n) -> n runs of `tree`'s cached forward in a loop, params, cache):
  what `forward_times` times; its compiled cost analysis counts the loop body, one forward,
  once (experiments/parallel_cycle.py reads its FLOPs)."""
  k = tree.k
  p, a = unrolled(heads.slice_params(params, heads.KINDS[args.head_kind], k),
                  dataclasses.replace(args, n_future=k))
  model = MTPModel(a)
  width = tree.n_nodes
  cache = init_decode_cache(a, batch, context + width + 1, dtype=a.dtype)
  toks = jnp.zeros((batch, width), jnp.int32)
  seg = None
  if is_tree(tree):  # a tree window: positions by depth, the mask as bits
    depth, bits = tree.window()
    pos = context + jnp.broadcast_to(jnp.asarray(depth), (batch, width))
    seg = jnp.broadcast_to(jnp.asarray(bits), (batch, width))
  else:
    pos = context + jnp.broadcast_to(jnp.arange(width), (batch, width))

  # the decoding loops' forward in two phases: head 1 over the window, then heads 2..k read at
  # one slot (parallel heads run their full block there alone; sequential depths read the
  # window's tokens as the known ones and draft beyond them)
  slot_B = jnp.zeros((batch,), jnp.int32)

  def body(p, w_DxV, carry):
    toks_BxW, c = carry
    fwd = Forward(model, p)
    h1_BxWxD, z_BxWxD, c = fwd.first(toks_BxW, pos, c, seg)
    out_BxW = jnp.argmax(h1_BxWxD @ w_DxV, -1)  # head 1 verifies every window token
    if k > 1:  # the drafting heads, at one slot (greedy cycles unembed them there only)
      h_K1xBxWxD, c = fwd.rest(toks_BxW, pos, c, z_BxWxD,
                               heads.Drafting(slot_B=slot_B, after_BxS=toks_BxW,
                                              unembed_DxV=w_DxV), seg)
      out_BxW = out_BxW + jnp.argmax(h_K1xBxWxD[:, :, :1] @ w_DxV, -1).sum(0)
    return out_BxW.astype(jnp.int32) % a.vocab_size, c

  # params are arguments, as in the decoding loops (closed over, they would be compiled in as
  # constants: another program than the one being modelled); the unembedding is taken once,
  # before the loop, as decode_chain does (XLA:CPU does not hoist it out of a loop body)
  def run(p, c, n):
    w_DxV = unembedding(p, a)[:, :a.vocab_size]
    return jax.lax.fori_loop(0, n, lambda _, x: body(p, w_DxV, x), (toks, c))[0]

  return jax.jit(run), p, cache


def chain(k: int) -> Tree:
  """The chain of k heads as a tree (k - 1 levels of one node)."""
  return Tree((1,) * (k - 1))


def candidates(n_future: int, trees: bool) -> list[Tree]:
  """Chains of 1..n_future heads, and (trees) the listed trees that fit n_future heads."""
  out = [chain(k) for k in range(1, n_future + 1)]
  if trees:
    out += [parse(s) for s in TREE_CANDIDATES if len(s.split(",")) < n_future]
  return out


def union(trees: list[Tree]) -> Tree:
  """The smallest spec holding every candidate as a sub-tree (max width at each depth)."""
  depth = max(len(t.spec) for t in trees)
  return Tree(tuple(max((t.spec[d] for t in trees if len(t.spec) > d), default=1)
                    for d in range(depth)))


def reached_depth(probe: Tree, cand: Tree) -> np.ndarray:
  """[N]: for each probe node as a cycle's deepest accepted node, the depth the candidate
  would have accepted on that cycle: the greedy token at depth d was the probe's rank-r node
  for d <= the node's depth (and ranked beyond the probe's width at the next depth)."""
  t = probe.tables
  depth, rank, at_depth = t.depth, t.rank, t.at_depth
  out = np.zeros(len(t.parent), np.int64)
  for n in range(len(t.parent)):
    reached = 0
    for d in range(1, min(depth[n], len(cand.spec)) + 1):
      if rank[at_depth[n, d]] >= cand.spec[d - 1]:
        break
      reached = d
    out[n] = reached
  return out


def expected_max(mean_B: np.ndarray, sd_B: np.ndarray, points: int = 2049) -> float:
  """E[max_b X_b] for independent X_b ~ Normal(mean_b, sd_b), by integrating
  E[max] = lo + int_lo^inf (1 - prod_b Phi((x - mean_b) / sd_b)) dx from lo = min mean - 9 sd."""
  mean_B, sd_B = np.asarray(mean_B, np.float64), np.maximum(np.asarray(sd_B, np.float64), 1e-12)
  lo, hi = float((mean_B - 9 * sd_B).min()), float((mean_B + 9 * sd_B).max())
  x = np.linspace(lo, hi, points)
  cdf = np.prod(special.ndtr((x[:, None] - mean_B) / sd_B), axis=1)
  return lo + float(np.trapezoid(1.0 - cdf, x))


def predict_a(hist_BxN: np.ndarray, probe: Tree, cand: Tree, *,
              max_new_tokens: int = 0) -> float:
  """The batch's predicted tokens per forward with `cand` (module docstring, docs/decoding.md
  "One pessimism rule"). Each row's mean a_b = 1 + E[depth reached], from its histogram smoothed
  toward the pooled one by PRIOR cycles, with the variance s_b^2 of the depth per cycle.
  max_new_tokens = N > 0: the expected slowest row. Row b needs C_b cycles for N tokens, its
  predictive distribution about Normal(N / a_b, N s_b^2 / a_b^3 + (N / a_b^2)^2 s_b^2 /
  (n_b + PRIOR)) (the decode's own spread, renewal theory; and the probe's error in a_b, n_b
  cycles + PRIOR), and the batch runs max_b C_b cycles: a = N / E[max_b C_b], in [1, N].
  Each risk counted once: the spread within a row, the probe's error, and the slowest of B.
  0: the slowest row's mean (no spread)."""
  hist_BxN = np.asarray(hist_BxN, np.float64)
  pooled_N = hist_BxN.sum(0) / max(hist_BxN.sum(), 1)
  n_B = hist_BxN.sum(1)
  p_BxN = (hist_BxN + PRIOR * pooled_N) / (n_B[:, None] + PRIOR)
  depth_N = reached_depth(probe, cand).astype(np.float64)
  mean_B = p_BxN @ depth_N
  a_B = 1.0 + mean_B
  if not max_new_tokens:
    return float(a_B.min())
  var_B = np.maximum(p_BxN @ depth_N ** 2 - mean_B ** 2, 0.0)
  n = float(max_new_tokens)
  cycles_B = n / a_B
  var_cycles_B = n * var_B / a_B ** 3 + (n / a_B ** 2) ** 2 * var_B / (n_B + PRIOR)
  slowest = expected_max(cycles_B, np.sqrt(var_cycles_B))
  return float(np.clip(n / max(slowest, 1.0), 1.0, n))


def probe_lengths(k: int, max_new_tokens: int) -> tuple[int, None]:
  """(short, None): the cycles of a probe's two timed runs, None the whole call (max_new_tokens
  tokens a row). Short: PROBE_CYCLES of a speculative window, PLAIN_PROBE_STEPS of plain
  decoding (k 1), at most half the whole call's cycles. The whole call, since a window of 4
  and 12 cycles (12 and 48 plain steps) left a cycle off by up to 40% at batch 1 on a CPU (the
  difference of two short calls is within their jitter), and since acceptance drifts over a
  decode (docs/decoding.md, "Where auto bets")."""
  short = PROBE_CYCLES if k > 1 else PLAIN_PROBE_STEPS
  return max(min(short, max_new_tokens // (2 * k)), 1), None


def cycle_and_fixed(timed: list[tuple[float, int, float, int]]) -> tuple[float, float]:
  """(seconds per cycle, seconds besides the cycles) of a window from its probe rounds, each
  (short run's seconds, its cycles, whole call's seconds, its cycles): a cycle is the median
  over rounds of the difference of the two runs per cycle, the fixed part what the short run
  spent beyond its cycles (at least 0). Where the difference is not above 0 (a call so short
  that its jitter hides the cycles: a 4.8k-parameter model at 32 tokens gave -0.09 ms), the
  whole call is taken as cycles: its seconds per cycle, no fixed part."""
  cycle = float(np.median([(f - s) / max(nf - ns, 1) for s, ns, f, nf in timed]))
  if not cycle > 0:
    return float(np.median([f / max(nf, 1) for _, _, f, nf in timed])), 0.0
  return cycle, max(float(np.median([s for s, *_ in timed])) - timed[0][1] * cycle, 0.0)


def call_speedup(a: float, t1: float, t: float, n: int = 0, f1: float = 0.0,
                 f: float = 0.0) -> float:
  """S of a call that makes n = max_new_tokens tokens: (f1 + n t1) / (f + n / a t), f1 and f
  what plain decoding's and the candidate's calls spend besides their cycles (the prefill, the
  call); a t1 / t, the cycles' ratio, when n is 0 or neither has a fixed part."""
  if not n or not (f1 or f):
    return a * t1 / t
  return (f1 + n * t1) / (f + n / a * t)


def table_row(cand, a: float, a_mean: float, t1: float, t: float | None, max_new_tokens: int = 0,
              f1: float = 0.0, f: float = 0.0, bound: float | None = None) -> dict:
  """A candidate's line in auto's table: its a (predicted, and the slowest row's mean), its
  seconds (T1, T; the calls' fixed parts F1, F) and the S they predict (`call_speedup`); where
  the candidate was not timed (t None: its `bounds` entry could not reach the best), no T and no
  S, only its bound ("S_bound")."""
  row = {"tree": cand.name, "heads": cand.k, "nodes": cand.n_nodes, "a_predicted": a,
         "a_mean": a_mean, "forward_1_seconds": t1, "forward_seconds": t,
         "fixed_1_seconds": f1, "fixed_seconds": f,
         "S_predicted": None if t is None else call_speedup(a, t1, t, max_new_tokens, f1, f)}
  return row if bound is None else dict(row, S_bound=bound)


def floor_window(cands: list[Tree]) -> Tree | None:
  """The chain of m heads, m the fewest heads of a speculative candidate: every speculative
  candidate's window holds at least its m tokens and runs at least its heads, so it costs at
  least the floor's time (`bounds`). None: no speculative candidate."""
  ks = [c.k for c in cands if c.k > 1]
  return chain(min(ks)) if ks else None


def predicted_a(hist_BxN, probe: Tree, cands: list[Tree], *,
                max_new_tokens: int = 0) -> dict[Tree, float]:
  """`predict_a` of every candidate, once: `bounds` and `choose` (twice in a decision) read it."""
  return {c: predict_a(hist_BxN, probe, c, max_new_tokens=max_new_tokens) for c in cands}


def bounds(a_of: dict, floor_seconds, *, max_new_tokens: int = 0,
           fixed=None) -> dict[Tree, float]:
  """Each speculative candidate's predicted S at most, before its window is timed: its predicted
  a (a_of, `predicted_a`) with the floor window's seconds (`floor_window`; floor_seconds = (T1,
  T_floor), each with its loop's factor) x BOUND_SLACK for its T, since its window does at least
  the floor's work. A candidate whose bound cannot reach MIN_GAIN (or an S already timed) cannot
  be chosen, so auto does not compile and time its window: on a CPU where a window of 2 tokens
  costs 1.5 one-token forwards and the heads accept little, that is every tree."""
  return {cand: _bound(a, floor_seconds, max_new_tokens, *(fixed(cand) if fixed else (0.0, 0.0)))
          for cand, a in a_of.items() if cand.k > 1}


def _bound(a: float, floor_seconds, max_new_tokens: int, f1: float, f: float) -> float:
  """S at most: a with the floor's T x BOUND_SLACK (`bounds`)."""
  t1, t = floor_seconds
  return call_speedup(a, t1, t * BOUND_SLACK, max_new_tokens, f1, f)


def dynamic_bound(a_static: float, k: int, floor_seconds, max_new_tokens: int = 0,
                  f1: float = 0.0, f: float = 0.0) -> tuple[float, float]:
  """(a, S) at most of tree=auto's dynamic tree, before it is probed: its a at most
  DYNAMIC_A_HEADROOM x a_static, the static tree's of as many nodes (and at most k), its T at
  least the floor's x BOUND_SLACK (`bounds`)."""
  a = min(float(k), DYNAMIC_A_HEADROOM * a_static)
  return a, _bound(a, floor_seconds, max_new_tokens, f1, f)


def choose(hist_BxN, probe: Tree, cands: list[Tree], seconds, *,
           max_new_tokens: int = 0, fixed=None, bound: dict | None = None,
           a_of: dict | None = None, a_mean_of: dict | None = None) -> dict:
  """The candidate of highest predicted S (`call_speedup`); seconds(tree) -> (T1, T)
  (`forward_times`, each with its loop's factor; T None: not timed, out of the running);
  fixed(tree) -> (F1, F), the calls' seconds besides their cycles (None: 0, so S = a x T1 / T);
  a from `predict_a` (max_new_tokens: the expected slowest row of a decode that long; "a_mean" in
  the table is the slowest row's mean; a_of, a_mean_of: those, computed already, `predicted_a`,
  from other probes where a candidate's acceptance is not the probe's to read); bound:
  `bounds`, kept in the table. Returns {"tree":
  Tree, "S_predicted", "a_predicted", "table": [...]} (plain decoding, the chain of 1, unless a
  candidate's S is at least MIN_GAIN)."""
  if a_of is None:
    a_of = predicted_a(hist_BxN, probe, cands, max_new_tokens=max_new_tokens)
  table = []
  for cand in cands:
    a_mean = (a_mean_of or {}).get(cand) or predict_a(hist_BxN, probe, cand)
    table.append(table_row(cand, a_of[cand], a_mean, *seconds(cand),
                           max_new_tokens, *(fixed(cand) if fixed else (0.0, 0.0)),
                           bound=(bound or {}).get(cand)))
  timed = [i for i in range(len(cands)) if table[i]["S_predicted"] is not None]
  best = max(timed, key=lambda i: table[i]["S_predicted"])
  if table[best]["S_predicted"] < MIN_GAIN:
    best = 0  # plain decoding
  return {"tree": cands[best], "S_predicted": 1.0 if best == 0 else table[best]["S_predicted"],
          "a_predicted": table[best]["a_predicted"], "table": table}
