"""One model's decoding session: k="auto" / tree="auto" decided by the cost model
(`mtp_jax.decoding.costmodel`) once per shape and mode, and the cost model's timings, kept on
the `Session` (bounded) and, where it is given one, in an on-disk cache
(`mtp_jax.decoding.timing_cache`) that a later process on the same machine and model reads
instead of probing again. Decodes through `decoder.Decoder`. Errors name the parameter
(`k: ...`), the CLIs their flags."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import numpy as np

from mtp_jax.decoding import costmodel
from mtp_jax.decoding import sampling as sampling_lib
from mtp_jax.decoding import timing_cache
from mtp_jax.decoding import tree as tree_lib
from mtp_jax.decoding.decoder import DecodeResult, Decoder, check_heads
from mtp_jax.model_args import ModelArgs

log = logging.getLogger(__name__)


PROBE_CYCLES = 12  # cycles of the probe run that measures acceptance for "auto"
PLAIN_PROBE_STEPS = 48  # plain decoding's steps in its timed probe (`probe_lengths`)
CACHE_SIZE = 32  # entries a Session keeps of each cache (the least recently used go first)


@dataclasses.dataclass
class _Probe:
  """What a probe's decode result is read for, as the disk cache keeps it."""
  rows_hist: np.ndarray
  forwards: int
  tokens_per_forward: float


def probe_lengths(k: int, max_new_tokens: int) -> tuple[int, int]:
  """(short, long): the cycles of a probe's two timed runs. A speculative window: PROBE_CYCLES
  // 3 and PROBE_CYCLES (the long run's histogram is the acceptance probe). Plain decoding (k
  1): PLAIN_PROBE_STEPS // 4 and PLAIN_PROBE_STEPS, its steps being a few times cheaper than a
  cycle; with 8 (0.1-0.4 ms each at batch 1 on a CPU) the difference was within a call's jitter
  and T1 came out up to 3x low (docs/decoding.md). Both within the call's max_new_tokens."""
  short, long = (PROBE_CYCLES // 3, PROBE_CYCLES) if k > 1 else (PLAIN_PROBE_STEPS // 4,
                                                                  PLAIN_PROBE_STEPS)
  long = max(min(long, max_new_tokens - 1), 2)
  return max(min(short, long // 3), 1), long


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
  keeps one session; `decode` / `resolve` / `choose` below use a fresh one per call.
  disk: a `timing_cache.DiskCache` (`timing_cache.default()`: the user's) that the probes and
  timed forwards are read from and written to, keyed by machine, model and shape, so a later
  session decides without measuring; None (the default): measured in every session.
  progress: called with a line as a decision starts and ends (what it probes, what it chose and
  what that took), for tools that run long (evaluate)."""

  def __init__(self, params, args: ModelArgs, cache_size: int = CACHE_SIZE,
               disk: timing_cache.DiskCache | None = None, progress=None):
    self.params, self.args, self.disk = params, args, disk
    self.progress = progress or (lambda line: None)
    self._choices, self._forward = _Bounded(cache_size), _Bounded(cache_size)
    self._base, self._params_key = None, None
    self.measured_seconds = 0.0  # spent probing and timing (not read from the disk cache)

  def _key(self, what: str, params: bool = False, **kw) -> dict:
    """A disk cache key: the machine and model's shape (and params' fingerprint), and `kw`."""
    if self._base is None:
      self._base = {"machine": timing_cache.machine(),
                    "model": timing_cache.model_shape(self.args)}
    if params and self._params_key is None:
      self._params_key = timing_cache.fingerprint(self.params)
    return dict(self._base, what=what, **({"params": self._params_key} if params else {}), **kw)

  def forward_times(self, trees: list, *, batch: int, context: int, reps: int = 11) -> dict:
    """`costmodel.forward_times` of this session's model, timed once per shape (kept on the
    session, and on disk where it has a cache: then only windows missing there are timed)."""
    trees = list(dict.fromkeys(trees))
    return self._forward.get((batch, context, tuple(trees), reps), lambda: self._timed(
        trees, batch=batch, context=context, reps=reps))

  def _timed(self, trees, *, batch, context, reps) -> dict:
    key = lambda t: self._key("forward", batch=batch, context=context, window=t.name, reps=reps)
    got = {t: self.disk.get(key(t)) for t in trees} if self.disk else {}
    missing = [t for t in trees if not isinstance(got.get(t), (int, float))]
    if missing:
      t0 = time.perf_counter()
      got.update(costmodel.forward_times(self.params, self.args, missing, batch=batch,
                                         context=context, reps=reps))
      self.measured_seconds += time.perf_counter() - t0
      for t in missing if self.disk else ():
        self.disk.put(key(t), got[t])
    return {t: float(got[t]) for t in trees}

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
    """(result, seconds per cycle, seconds besides the cycles) of `tree` (None: the chain of
    k): `_run_probe`'s, or what the disk cache kept of it for this model and shape."""
    key = self.disk and self._key(
        "probe", params=True, batch=len(prompts), max_new_tokens=max_new_tokens, k=k,
        prompt_bucket=timing_cache.prompt_bucket(max(len(p) for p in prompts)),
        window=f"chain:{k}" if tree is None else tree.name,
        lengths=list(probe_lengths(k if tree is None else tree.k, max_new_tokens)),
        sampling={n: v for n, v in sample_kw.items() if n != "seed"} if sampling else None)
    hit = self.disk.get(key) if key else None
    try:
      if hit is not None:
        return (_Probe(np.asarray(hit["rows_hist"], np.int64), int(hit["forwards"]),
                       float(hit["tokens_per_forward"])), float(hit["cycle_seconds"]),
                float(hit["fixed_seconds"]))
    except (KeyError, TypeError, ValueError) as e:
      log.warning("timing cache: ignoring a probe entry (%s: %s); probing again",
                  type(e).__name__, e)
    t0 = time.perf_counter()
    r, cycle_seconds, fixed_seconds = self._run_probe(
        prompts, tree, k=k, max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id,
        pad_id=pad_id, sample_kw=sample_kw)
    self.measured_seconds += time.perf_counter() - t0
    if key:
      self.disk.put(key, {"rows_hist": np.asarray(r.rows_hist).tolist(), "forwards": r.forwards,
                          "tokens_per_forward": r.tokens_per_forward,
                          "cycle_seconds": cycle_seconds, "fixed_seconds": fixed_seconds})
    return r, cycle_seconds, fixed_seconds

  def _run_probe(self, prompts, tree, *, k, max_new_tokens, sampling, eos_id, pad_id,
                 sample_kw):
    """(result, seconds per cycle, seconds besides the cycles) of `tree` (None: the chain of k)
    on the call's prompts: runs of the two `probe_lengths`, the fastest of 3 interleaved rounds
    each; the slope between them is a cycle, and what the short run spent beyond its cycles
    the call's fixed part (its prefill, the call itself: with 128 new tokens at 0.3 ms a plain
    step, a prefill of 256 tokens and the call were a third of plain decoding's time here)."""
    dec = Decoder(self.params, self.args, k=k, batch=len(prompts),
                  prompt_len=max(len(p) for p in prompts), max_new_tokens=max_new_tokens,
                  sampling=sampling, tree=tree)
    lengths = probe_lengths(k if tree is None else tree.k, max_new_tokens)
    runs = {c: [] for c in lengths}
    for _ in range(3):
      for c, rs in runs.items():
        rs.append(dec(prompts, eos_id=eos_id, pad_id=pad_id, max_cycles=c, **sample_kw))
    short, full = (runs[c] for c in lengths)
    r = full[0]  # the acceptance histograms (every round decodes the same)
    t_short = min(x.seconds for x in short)
    cycle = (min(x.seconds for x in full) - t_short) / max(r.forwards - short[0].forwards, 1)
    return r, cycle, max(t_short - short[0].forwards * cycle, 0.0)

  def _decide(self, prompts, *, max_new_tokens, k, n, trees, sampling, eos_id, pad_id,
              sample_kw) -> dict:
    batch, width = len(prompts), max(len(p) for p in prompts)
    t0, measured0 = time.perf_counter(), self.measured_seconds
    cands = costmodel.candidates(n, trees)
    if k != "auto":  # tree="auto" with k heads: plain, the chain of k, trees of <= k heads
      cands = [c for c in cands if c.k == 1 or c.k == k or (c.k < k and max(c.spec) > 1)]
    probe = costmodel.union(cands)
    self.progress(f"auto: deciding for batch {batch}, prompt width {width}, {max_new_tokens} new "
                  f"tokens among {len(cands)} candidates (probes and timed forwards"
                  + (f", read from {self.disk.root} where kept)" if self.disk else ")"))
    kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, pad_id=pad_id,
              sample_kw=sample_kw)
    r, cycle_seconds, fixed = self._probe(prompts, probe if trees else None, k=probe.k, **kw)
    _, plain_cycle_seconds, plain_fixed = self._probe(prompts, None, k=1, **kw)  # plain's loop
    context = timing_cache.prompt_bucket(width) + max_new_tokens // 2

    one, floor = costmodel.chain(1), costmodel.floor_window(cands)
    timing = dict(batch=batch, context=context)
    times = dict(self.forward_times([one, probe] + ([floor] if floor else []), **timing))
    # The loops' own cost (acceptance, drafting, cache bookkeeping) beyond the forward: seconds
    # per cycle over the window's forward timed in a loop (`costmodel.forward_times`), measured
    # on the probe for every speculative candidate and on plain decoding's loop for T1.
    loop_factor = max(1.0, cycle_seconds / times[probe])
    plain_loop_factor = max(1.0, plain_cycle_seconds / times[one])
    seconds = lambda c: (times[one] * plain_loop_factor,
                         None if c not in times else
                         times[c] * (loop_factor if c.k > 1 else plain_loop_factor))
    pessimism = dict(max_new_tokens=max_new_tokens)  # the expected slowest row
    # each call's fixed part: plain decoding's from its probe, every candidate's from the probe's
    fixed_of = lambda c: (plain_fixed, fixed if c.k > 1 else plain_fixed)
    # Only the windows that could win are compiled and timed: a candidate's S is at most its a
    # with the floor window's time (`costmodel.bounds`); under the best S timed so far (or
    # MIN_GAIN) it cannot be chosen.
    a_of = costmodel.predicted_a(r.rows_hist, probe, cands, **pessimism)
    bound = costmodel.bounds(a_of, seconds(floor), fixed=fixed_of, **pessimism) if floor else {}
    so_far = costmodel.choose(r.rows_hist, probe, [c for c in cands if c in times], seconds,
                              fixed=fixed_of, a_of=a_of, **pessimism)["S_predicted"]
    more = [c for c in cands if c not in times and bound[c] >= max(costmodel.MIN_GAIN, so_far)]
    if more:
      times.update(self.forward_times(more, **timing))

    picked = costmodel.choose(r.rows_hist, probe, cands, seconds, fixed=fixed_of, bound=bound,
                              a_of=a_of, **pessimism)
    best = picked.pop("tree")
    if trees:  # the dynamic tree of as many nodes as the best static tree, probed on its own
      picked, best = self._dynamic(prompts, picked, best, k=probe.k, pessimism=pessimism,
                                   floor_seconds=seconds(floor), **kw)
    spent = time.perf_counter() - t0
    label = ("plain decoding" if best.k == 1 else f"tree {best.name}" if tree_lib.is_tree(best)
             else f"heads 1..{best.k}")
    timed = sum(row["S_predicted"] is not None for row in picked["table"])
    self.progress(f"auto: {label} (predicted S {picked['S_predicted']:.2f}); deciding took "
                  f"{spent:.1f}s, {self.measured_seconds - measured0:.1f}s of it measured; "
                  f"{timed} of {len(picked['table'])} candidates timed, the rest could not win")
    return dict(picked, heads=best.k, tree=best if tree_lib.is_tree(best) else None,
                probe={"tree": probe.name, "cycles": int(r.forwards) - 1,
                       "tokens_per_forward": r.tokens_per_forward, "loop_factor": loop_factor,
                       "cycle_seconds": cycle_seconds, "plain_loop_factor": plain_loop_factor,
                       "plain_cycle_seconds": plain_cycle_seconds, "fixed_seconds": fixed,
                       "plain_fixed_seconds": plain_fixed},
                seconds=spent,
                measured_seconds=self.measured_seconds - measured0,  # 0: all from the cache
                cache=self.disk.root if self.disk else None)

  def _dynamic(self, prompts, picked, best, *, k, pessimism, floor_seconds, **kw):
    """`tree=auto`'s dynamic candidate: dynamic:N over heads 2..k, N the node count of the static
    tree of highest predicted S (or bound, where not timed); its a from a probe of its own (the
    slowest row's, smoothed as `costmodel.predict_a` does, from its histogram by depth), its T
    from its window's timed forward times its probe's own loop factor. (picked, best) again,
    with it in the table, and chosen where its S is the highest and at least MIN_GAIN. Probed
    only where its own bound (`costmodel.dynamic_bound`) reaches the best S and MIN_GAIN; else
    its row holds the bound."""
    static = [row for row in picked["table"] if row["nodes"] > row["heads"]]  # not chains
    if not static:
      return picked, best
    s_of = lambda row: row["S_bound"] if row["S_predicted"] is None else row["S_predicted"]
    top = max(static, key=s_of)
    dyn = tree_lib.Dynamic(top["nodes"], k - 1)
    a, bound = costmodel.dynamic_bound(top["a_predicted"], k, floor_seconds, kw["max_new_tokens"],
                                       top["fixed_1_seconds"], top["fixed_seconds"])
    if bound < max(costmodel.MIN_GAIN, picked["S_predicted"]):
      row = costmodel.table_row(dyn, a, a, top["forward_1_seconds"], None, bound=bound)
      return dict(picked, table=picked["table"] + [row]), best
    r, cycle_seconds, fixed = self._probe(prompts, dyn, k=k, **kw)
    width = timing_cache.prompt_bucket(max(len(p) for p in prompts))
    t = self.forward_times([costmodel.chain(1), dyn], batch=len(prompts),
                           context=width + kw["max_new_tokens"] // 2)
    a = costmodel.predict_a(r.rows_hist, costmodel.chain(k), costmodel.chain(k), **pessimism)
    T = t[dyn] * max(1.0, cycle_seconds / t[dyn])
    row = costmodel.table_row(
        dyn, a, costmodel.predict_a(r.rows_hist, costmodel.chain(k), costmodel.chain(k)),
        top["forward_1_seconds"], T, kw["max_new_tokens"], top["fixed_1_seconds"], fixed)
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

