"""Greedy and sampled decoding, plain and self-speculative with the MTP heads (Gloeckle et al.
2024 §3.2; Stern et al. 2018; Leviathan et al. 2023).

One cycle feeds [last accepted token, drafts d_1..d_{k-1}] at positions L..L+k-1 through the
trunk and heads 1..k with a KV cache; head 1 at slot j gives the token for position L+j+1.
Greedy: d_j is accepted while d_j == argmax g_{j-1}, so a row gains m + 1 tokens for m accepted
drafts. Sampling (`mtp_jax.decoding.sampling`): d_j is accepted with probability
min(1, p(d_j) / q_j(d_j)), the first rejection draws from normalise(max(0, p - q)), so the
output is distributed exactly as plain sampling from head 1. Heads 2..k at the last accepted
slot propose the next drafts (rollback by length). k = 1 is plain decoding (docs/decoding.md).

The loop is one jit (`decode_loop.decode_chain`, per-row lengths and EOS); `Decoder` compiles it
for one batch shape. Trees (`tree=`, static or dynamic, greedy or sampled):
`mtp_jax.decoding.tree`. k="auto" / tree="auto": `Session.choose`, by the cost model
(`mtp_jax.decoding.costmodel`), once per shape, kept on the `Session` (bounded). Errors name
the parameter (`k: ...`), the CLIs their flags."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import acceptance, backends, heads
from mtp_jax.decoding import costmodel
from mtp_jax.decoding import sampling as sampling_lib
from mtp_jax.decoding import tree as tree_lib
from mtp_jax.decoding.costmodel import forward_seconds  # noqa: F401  (the cost model's inputs)
from mtp_jax.decoding.decode_loop import Accepted, accept_greedy, decode_chain, gain  # noqa: F401
from mtp_jax.model_args import ModelArgs

log = logging.getLogger(__name__)


def check_heads(args: ModelArgs, k: int) -> None:
  if not 1 <= k <= args.n_future:
    raise ValueError(f"k: must be between 1 and the model's n_future ({args.n_future}), got {k}")


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
  heads: int = 0  # k, the heads that ran (1: plain decoding)
  tree: str | None = None  # the draft tree's spec (None: a chain)
  rows_hist: np.ndarray | None = None  # [B, k] (a tree: [B, nodes]) accepted_hist per row
  auto: dict | None = None  # what heads="auto" / tree="auto" measured and chose (`choose`)

  @property
  def tokens_per_forward(self) -> float:
    """a: mean tokens gained per verification forward (the first token, from prefill, aside)."""
    return float((self.lengths - 1).sum() / max(self.cycles.sum(), 1))

  def acceptance_by_position(self) -> np.ndarray:
    """P(draft j accepted), j = 1..k-1: the chance that at least j drafts pass in a cycle."""
    h = self.accepted_hist
    return np.asarray([h[j:].sum() / max(h.sum(), 1) for j in range(1, len(h))])

  def alpha_by_position(self) -> np.ndarray:
    """alpha_j = P(draft j accepted | drafts < j accepted), j = 1..k-1 (mtp_jax.acceptance)."""
    return acceptance.conditional(self.acceptance_by_position())


class Decoder:
  """Decoding with heads 1..k (k = 1: plain decoding with head 1) of `batch` prompts padded to
  `prompt_len`, for `max_new_tokens`, compiled ahead of time in the constructor
  (`compile_seconds`), so that calls time the decode alone. `sampling=True` compiles the
  sampling program (temperature, top_k, top_p and seed are then arguments of each call, and
  temperature 0 in it is greedy); False, the greedy one. `tree` (a `tree.Tree` or
  `tree.Dynamic`, parallel and projection heads, k = its levels + 1; a Dynamic without levels
  takes k - 1): tree drafts (`mtp_jax.decoding.tree`).
  Prompts are validated here, at the entry point. `compiler_options`: XLA's compile options,
  by default `backends.current().decode_compiler_options(batch)` (on a CPU backend,
  `backends.cpu.runtime.decode_compiler_options`); an override is for benchmarks of those
  options (experiments/bench_decode_options.py): speculative decoding stays exact only where
  every program of a batch compiles with the same ones."""

  def __init__(self, params, args: ModelArgs, *, k: int, batch: int, prompt_len: int,
               max_new_tokens: int, sampling: bool = False,
               tree: tree_lib.Tree | tree_lib.Dynamic | None = None,
               stops=None, compiler_options: dict | None | str = "auto"):
    check_heads(args, k)
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > args.max_len:
      raise ValueError(f"max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens "
                       f"({max_new_tokens}) exceeds the model's max_len ({args.max_len})")
    if isinstance(tree, tree_lib.Dynamic) and tree.levels is None:
      tree = dataclasses.replace(tree, levels=k - 1)
    if tree is not None:
      if tree.k != k or k < 2 or tree_lib.unsupported_reason(args):
        raise ValueError(f"tree: {tree.name} needs {max(tree.k, 2)} heads (k) of a kind in "
                         f"{heads.tree_kinds()}")
    self.params, self.args = slice_heads(params, args, k)
    self.batch, self.prompt_len, self.max_new_tokens = batch, prompt_len, max_new_tokens
    # stops: a stops.Matcher (rows end once their cut at a stop sequence is decided); a tree
    # decodes to the budget and the caller's cut gives the same text.
    self.sampling, self.tree, self.k = sampling, tree, k
    self.stops = stops if tree is None else None
    t0 = time.perf_counter()
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    options = (backends.current().decode_compiler_options(batch) if compiler_options == "auto"
               else compiler_options)
    common = (self.params, i32(batch, prompt_len), i32(batch), i32(), i32(),
              sampling_lib.Settings(f32, i32(), f32), i32(), i32())
    if tree is None:
      lowered = decode_chain.lower(*common, self.stops, args=self.args,
                                   max_new_tokens=max_new_tokens, sample=sampling)
    else:
      lowered = tree_lib.decode_tree.lower(*common, args=self.args, max_new_tokens=max_new_tokens,
                                           tree=tree, sample=sampling)
    self._compiled = lowered.compile(compiler_options=options)
    self.compile_seconds = time.perf_counter() - t0

  def __call__(self, prompts: list, *, eos_id: int, pad_id: int, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               max_cycles: int | None = None) -> DecodeResult:
    """Decodes token-id prompts (ragged lists; `batch` of them, none longer than prompt_len).
    Row b draws its samples from (seed, b): the same prompt list and seed give the same output.
    max_cycles: stop after that many verification forwards (a probe; default: none)."""
    sampling_lib.check(temperature, top_k, top_p, seed)
    if temperature > 0 and not self.sampling:
      raise ValueError("temperature: this Decoder was compiled for greedy decoding; build it "
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
    cap = np.int32(2**30 if max_cycles is None else max_cycles)
    ids = (self.params, prompt_BxP, lens_B, np.int32(eos_id), np.int32(pad_id))
    t0 = time.perf_counter()
    sp = sampling_lib.Settings(np.float32(temperature), np.int32(top_k), np.float32(top_p))
    if self.tree is None:
      out = jax.device_get(self._compiled(*ids, sp, np.int32(seed), cap, self.stops))
    else:
      out = jax.device_get(self._compiled(*ids, sp, np.int32(seed), cap))
    seconds = time.perf_counter() - t0
    tokens, n_out, cycles, rows_hist, forwards = map(np.asarray, out)
    hist = tree_lib.by_depth(rows_hist.sum(0), self.tree, self.k)  # by drafts accepted
    return DecodeResult(tokens=tokens, lengths=n_out, cycles=cycles, accepted_hist=hist,
                        forwards=int(forwards), seconds=seconds,
                        compile_seconds=self.compile_seconds, heads=self.k,
                        tree=None if self.tree is None else self.tree.name, rows_hist=rows_hist)


PROBE_CYCLES = 12  # cycles of the probe run that measures acceptance for "auto"
CACHE_SIZE = 32  # entries a Session keeps of each cache (the least recently used go first)


class _Bounded:
  """At most `size` entries, the least recently used dropped first."""

  def __init__(self, size: int):
    self.size, self._d = size, collections.OrderedDict()

  def get(self, key, make):
    if key not in self._d:
      self._d[key] = make()
      if len(self._d) > self.size:
        self._d.popitem(last=False)
    self._d.move_to_end(key)
    return self._d[key]

  def __len__(self) -> int:
    return len(self._d)


class Session:
  """Decoding with one model (params, args): what heads="auto" / tree="auto" decided (`choose`)
  and what the cost model timed (`forward_times`), per shape and mode, kept for the session's
  life (at most `cache_size` entries of each). The session holds the params it measured, so an
  entry never outlives them or serves other params. A caller decoding many batches (pass@k)
  keeps one session; `decode` / `resolve` / `choose` below use a fresh one per call."""

  def __init__(self, params, args: ModelArgs, cache_size: int = CACHE_SIZE):
    self.params, self.args = params, args
    self._choices, self._forward = _Bounded(cache_size), _Bounded(cache_size)

  def forward_times(self, trees: list, *, batch: int, context: int, reps: int = 11) -> dict:
    """`costmodel.forward_times` of this session's model, timed once per shape."""
    trees = list(dict.fromkeys(trees))
    return self._forward.get((batch, context, tuple(trees), reps), lambda: costmodel.forward_times(
        self.params, self.args, trees, batch=batch, context=context, reps=reps))

  def choose(self, prompts: list, *, max_new_tokens: int, k, tree, eos_id: int, pad_id: int,
             sample_kw: dict) -> dict:
    """heads="auto" and/or tree="auto": the k (or tree) of highest predicted speed-up for this
    call's batch, prompt width and mode (`mtp_jax.decoding.costmodel`), decided once per shape
    and mode. Returns {"heads", "tree" (a Tree or None), "S_predicted", "a_predicted", "table",
    "probe", "seconds"} ("seconds": what deciding took, compilation of the probe included; like
    compile time, apart from the decode's)."""
    args = self.args
    sampling = sample_kw.get("temperature", 0) > 0
    trees = tree == "auto" and tree_lib.unsupported_reason(args) is None
    if tree == "auto" and not trees:
      log.warning("tree auto: %s; choosing among chains", tree_lib.unsupported_reason(args))
    n = args.n_future if k == "auto" else k
    key = (len(prompts), max(len(p) for p in prompts), max_new_tokens, sampling, n, trees)
    return self._choices.get(key, lambda: self._decide(
        prompts, max_new_tokens=max_new_tokens, k=k, n=n, trees=trees, sampling=sampling,
        eos_id=eos_id, pad_id=pad_id, sample_kw=sample_kw))

  def _probe(self, prompts, tree, *, k, max_new_tokens, sampling, eos_id, pad_id, sample_kw):
    """(result, seconds per cycle) of `tree` (None: the chain of k) on the call's prompts: runs
    of PROBE_CYCLES and of PROBE_CYCLES // 3 cycles (the difference cancels the prefill and the
    call), the fastest of 3 interleaved rounds each."""
    dec = Decoder(self.params, self.args, k=k, batch=len(prompts),
                  prompt_len=max(len(p) for p in prompts), max_new_tokens=max_new_tokens,
                  sampling=sampling, tree=tree)
    runs = {c: [] for c in (PROBE_CYCLES // 3, PROBE_CYCLES)}
    for _ in range(3):
      for c, rs in runs.items():
        rs.append(dec(prompts, eos_id=eos_id, pad_id=pad_id, max_cycles=c, **sample_kw))
    short, full = runs[PROBE_CYCLES // 3], runs[PROBE_CYCLES]
    r = full[0]  # the acceptance histograms (every round decodes the same)
    return r, ((min(x.seconds for x in full) - min(x.seconds for x in short))
               / max(r.forwards - short[0].forwards, 1))

  def _decide(self, prompts, *, max_new_tokens, k, n, trees, sampling, eos_id, pad_id,
              sample_kw) -> dict:
    batch, width = len(prompts), max(len(p) for p in prompts)
    t0 = time.perf_counter()
    cands = costmodel.candidates(n, trees)
    if k != "auto":  # tree="auto" with k heads: plain, the chain of k, trees of <= k heads
      cands = [c for c in cands if c.k == 1 or c.k == k or (c.k < k and max(c.spec) > 1)]
    probe = costmodel.union(cands)
    kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, pad_id=pad_id,
              sample_kw=sample_kw)
    r, cycle_seconds = self._probe(prompts, probe if trees else None, k=probe.k, **kw)
    _, plain_cycle_seconds = self._probe(prompts, None, k=1, **kw)  # plain decoding's loop
    context = width + max_new_tokens // 2

    one = costmodel.chain(1)
    times = self.forward_times([one, probe] + cands, batch=batch, context=context)
    # The loops' own cost (acceptance, drafting, cache bookkeeping) beyond the forward: seconds
    # per cycle over the window's forward timed in a loop (`costmodel.forward_times`), measured
    # on the probe for every speculative candidate and on plain decoding's loop for T1.
    loop_factor = max(1.0, cycle_seconds / times[probe])
    plain_loop_factor = max(1.0, plain_cycle_seconds / times[one])
    seconds = lambda c: (times[one] * plain_loop_factor,
                         times[c] * (loop_factor if c.k > 1 else plain_loop_factor))
    pessimism = dict(max_new_tokens=max_new_tokens)  # the expected slowest row

    picked = costmodel.choose(r.rows_hist, probe, cands, seconds, **pessimism)
    best = picked.pop("tree")
    if trees:  # the dynamic tree of as many nodes as the best static tree, probed on its own
      picked, best = self._dynamic(prompts, picked, best, k=probe.k, pessimism=pessimism, **kw)
    return dict(picked, heads=best.k, tree=best if tree_lib.is_tree(best) else None,
                probe={"tree": probe.name, "cycles": int(r.forwards) - 1,
                       "tokens_per_forward": r.tokens_per_forward, "loop_factor": loop_factor,
                       "cycle_seconds": cycle_seconds, "plain_loop_factor": plain_loop_factor,
                       "plain_cycle_seconds": plain_cycle_seconds},
                seconds=time.perf_counter() - t0)

  def _dynamic(self, prompts, picked, best, *, k, pessimism, **kw):
    """`tree=auto`'s dynamic candidate: dynamic:N over heads 2..k, N the node count of the static
    tree of highest predicted S; its a from a probe of its own (the slowest row's, smoothed as
    `costmodel.predict_a` does, from its histogram by depth), its T from its window's timed
    forward times its probe's own loop factor. (picked, best) again, with it in the table, and
    chosen where its S is the highest and at least MIN_GAIN."""
    static = [row for row in picked["table"] if row["nodes"] > row["heads"]]  # not chains
    if not static:
      return picked, best
    top = max(static, key=lambda row: row["S_predicted"])
    dyn = tree_lib.Dynamic(top["nodes"], k - 1)
    r, cycle_seconds = self._probe(prompts, dyn, k=k, **kw)
    t = self.forward_times([costmodel.chain(1), dyn], batch=len(prompts),
                           context=max(len(p) for p in prompts) + kw["max_new_tokens"] // 2)
    a = costmodel.predict_a(r.rows_hist, costmodel.chain(k), costmodel.chain(k), **pessimism)
    T = t[dyn] * max(1.0, cycle_seconds / t[dyn])
    row = {"tree": dyn.name, "heads": dyn.k, "nodes": dyn.nodes, "a_predicted": a,
           "a_mean": costmodel.predict_a(r.rows_hist, costmodel.chain(k), costmodel.chain(k)),
           "forward_1_seconds": top["forward_1_seconds"], "forward_seconds": T,
           "S_predicted": a * top["forward_1_seconds"] / T}
    picked = dict(picked, table=picked["table"] + [row])
    if row["S_predicted"] >= max(costmodel.MIN_GAIN, picked["S_predicted"]):
      return dict(picked, S_predicted=row["S_predicted"], a_predicted=a), dyn
    return picked, best

  def resolve(self, prompts: list, *, max_new_tokens: int, k, tree, eos_id: int, pad_id: int,
              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0):
    """What `decode` runs for these arguments: (k, Tree or None, the `choose` record or None).
    Checks k and tree (one ValueError naming k or tree); sequential heads fall back from a tree
    to the chain with a logged reason."""
    args = self.args
    if k is None:
      k = args.n_future
    if k != "auto":
      if isinstance(k, str) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"k: an integer 1..n_future ({args.n_future}) or auto, got {k!r}")
      check_heads(args, int(k))
    if tree is not None and tree != "auto":
      tree = tree_lib.parse(tree, args.n_future)
      if isinstance(tree, tree_lib.Dynamic) and k != "auto":  # its depths: heads 2..k
        if k < 2:
          raise ValueError(f"tree: {tree.name} drafts with heads 2..k, but k is {k}")
        tree = dataclasses.replace(tree, levels=int(k) - 1)
      if k not in ("auto", tree.k, args.n_future):
        raise ValueError(f"tree: {tree.name} uses heads 1..{tree.k}, but k is {k}")
      k = tree.k
      why = tree_lib.unsupported_reason(args)
      if why:
        log.warning("tree %s: %s; decoding with the chain of %d heads", tree.name, why, k)
        tree = None
    if isinstance(tree, tree_lib.Tree) and not tree_lib.is_tree(tree):
      tree = None  # a chain: the chain loop
    auto = None
    if k == "auto" or tree == "auto":
      sample_kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
      auto = self.choose(prompts, max_new_tokens=max_new_tokens, k=k, tree=tree, eos_id=eos_id,
                         pad_id=pad_id, sample_kw=sample_kw)
      k, tree = auto["heads"], auto["tree"]
      auto = {key: (v.name if isinstance(v, (tree_lib.Tree, tree_lib.Dynamic)) else v)
              for key, v in auto.items()}
    return int(k), tree, auto

  def decode(self, prompts: list, *, max_new_tokens: int, k=None, eos_id: int, pad_id: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             tree=None, stops=None) -> DecodeResult:
    """Decodes a batch of token-id prompts (ragged lists) with heads 1..k; k = 1 is plain
    decoding with head 1 (None: all heads). temperature 0: greedy (top_k, top_p, seed unused);
    > 0: sampling with temperature, then top_k (0 = off), then top_p (1 = off), row b seeded by
    (seed, b); with k > 1 speculative sampling, distributed exactly as plain sampling.
    num_samples samples of a prompt: `repeat(prompts, num_samples)`. stops: a `stops.Matcher`;
    a row also ends once its text's cut at a stop sequence is decided (the tokens up to there
    are those of a full-length decode).

    k="auto": the k of highest predicted speed-up for this batch (`choose`; plain decoding where
    speculation would lose). tree: a spec such as "4,2,1" (`mtp_jax.decoding.tree`; its levels
    + 1 heads), "dynamic:N" (N nodes, the most likely paths of heads 2..k, chosen per cycle)
    or "auto" (a tree, dynamic or static, or a chain, chosen the same way); greedy or sampled
    (exactly as plain sampling); sequential heads fall back to the chain, with a logged
    reason. The result's `heads`, `tree` and `auto`
    say what ran."""
    sampling_lib.check(temperature, top_k, top_p, seed)
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("prompt: every prompt needs at least one token")
    kw = dict(eos_id=eos_id, pad_id=pad_id, temperature=temperature, top_k=top_k, top_p=top_p,
              seed=seed)
    k, tree, auto = self.resolve(prompts, max_new_tokens=max_new_tokens, k=k, tree=tree, **kw)
    decoder = Decoder(self.params, self.args, k=k, batch=len(prompts),
                      prompt_len=max(len(p) for p in prompts), max_new_tokens=max_new_tokens,
                      sampling=temperature > 0, tree=tree, stops=stops)
    result = decoder(prompts, **kw)
    result.auto = auto
    return result


def choose(params, args: ModelArgs, prompts: list, **kw) -> dict:
  """`Session.choose` with a fresh session."""
  return Session(params, args).choose(prompts, **kw)


def resolve(params, args: ModelArgs, prompts: list, **kw):
  """`Session.resolve` with a fresh session."""
  return Session(params, args).resolve(prompts, **kw)


def decode(params, args: ModelArgs, prompts: list, **kw) -> DecodeResult:
  """`Session.decode` with a fresh session (k="auto" decides anew: keep a `Session` to decide
  once per shape over many calls)."""
  return Session(params, args).decode(prompts, **kw)


def plain(params, args: ModelArgs, prompts: list, **kw) -> DecodeResult:
  """Plain decoding with head 1 alone (k = 1), the baseline: greedy, or sampled (temperature)."""
  return decode(params, args, prompts, k=1, **kw)


def repeat(prompts: list, num_samples: int) -> list:
  """Each prompt num_samples times in a row (rows i * num_samples + s, s < num_samples): the
  batch that draws num_samples independent samples of every prompt (pass@k)."""
  if not isinstance(num_samples, int) or num_samples < 1:
    raise ValueError(f"num_samples: must be an integer >= 1, got {num_samples!r}")
  return [p for p in prompts for _ in range(num_samples)]
