"""One model's decoding session: k="auto" / tree="auto" decided by the cost model
(`mtp_jax.decoding.costmodel`) once per shape and mode, and the cost model's timings, kept on
the `Session` (bounded) and, where it is given one, in an on-disk cache
(`mtp_jax.decoding.timing_cache`) that a later process on the same machine and model reads
instead of probing again. Decodes through `decoder.Decoder`. Errors name the parameter
(`k: ...`), the CLIs their flags."""

from __future__ import annotations

import logging
import time

import numpy as np

from mtp_jax.decoding import costmodel
from mtp_jax.decoding import probes as probes_lib
from mtp_jax.decoding import sampling as sampling_lib
from mtp_jax.decoding import timing_cache
from mtp_jax.decoding import tree as tree_lib
from mtp_jax.decoding.decoder import DecodeResult, Decoder, check_window
from mtp_jax.model_args import ModelArgs

log = logging.getLogger(__name__)


PROBE_ROUNDS = 3  # timed rounds of a probe's two runs (`Session._run_probes`)
VERIFY_PICKS = 2  # candidates near the bar whose own loop auto probes (`Session._decide`)
VERIFY_NEAR = 0.9  # ... and candidates predicted this close to MIN_GAIN: a T from forward
# ratios was off by up to 20% at batch 1 (chain:2 predicted 0.99, measured 1.22)
BET_PROBES = 2  # own-loop probes a bet's T and fixed part average: a pick read from one is
# probed again and chosen again (`Session._decide`; the dynamic tree: `Session._dynamic`)
HELD_OUT = True  # a bet's S reported from one more own-loop probe, one the choice did not use
# (`Session._held_out`): the readings a choice keeps drew high
CACHE_SIZE = 32  # entries a Session keeps of each cache (the least recently used go first)


def _own_a(hist, window, pessimism: dict) -> tuple[float, float]:
  """(a, the slowest row's mean a) of a window read from a probe of its own loop (`hist`); a
  dynamic tree's histogram is by depth, read as the chain of its heads."""
  by = costmodel.chain(window.k) if isinstance(window, tree_lib.Dynamic) else window
  return costmodel.predict_a(hist, by, by, **pessimism), costmodel.predict_a(hist, by, by)


def _loop(window) -> tuple:
  """(tree, k) of a window's own decoding loop, as `Session._probes` takes it (tree None: the
  chain of k)."""
  return window if tree_lib.is_tree(window) else None, window.k


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
    self._choices = timing_cache.Bounded(cache_size)
    self._forward = timing_cache.Bounded(cache_size)
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
    """`costmodel.forward_times` of this session's model, each window timed once per shape (kept
    on the session, and on disk where it has a cache). Windows timed later than others of their
    shape are timed beside the largest of those and scaled by its time then and now, so every
    time of a shape is on one scale (S compares them: a window timed a minute later, on a machine
    running 20% slower, would lose by that alone)."""
    trees = list(dict.fromkeys(trees))
    known = self._forward.get((batch, context, reps), dict)
    missing = [t for t in trees if t not in known]
    if missing:
      known.update(self._timed(missing, known, batch=batch, context=context, reps=reps))
      known.update(costmodel.monotone(known))
    return {t: known[t] for t in trees}

  def _timed(self, trees, known, *, batch, context, reps) -> dict:
    key = lambda t: self._key("forward", batch=batch, context=context, window=t.name, reps=reps)
    got = {t: self.disk.get(key(t)) for t in trees} if self.disk else {}
    got = {t: float(v) for t, v in got.items() if isinstance(v, (int, float))}
    missing = [t for t in trees if t not in got]
    if missing:
      have = {**known, **got}  # what this shape holds already: the new times join its scale
      ref = max(have, key=lambda t: (t.n_nodes, t.k)) if have else None
      t0 = time.perf_counter()
      new = costmodel.forward_times(self.params, self.args, missing + ([ref] if ref else []),
                                    batch=batch, context=context, reps=reps)
      self.measured_seconds += time.perf_counter() - t0
      scale = have[ref] / new[ref] if ref else 1.0
      got.update({t: new[t] * scale for t in missing})
      for t in missing if self.disk else ():
        self.disk.put(key(t), got[t])
    return got

  def choose(self, prompts: list, *, max_new_tokens: int, k, tree, eos_id: int, pad_id: int,
             sample_kw: dict) -> dict:
    """heads="auto" and/or tree="auto": the k (or tree) of highest predicted speed-up for this
    call's batch, prompt width and mode (`mtp_jax.decoding.costmodel`), decided once per shape
    and mode. Returns {"heads", "tree" (a Tree or None), "S_predicted", "a_predicted", "table",
    "probe", "seconds"; "chain_probe" where sampled with tree=auto} ("seconds": what deciding
    took, compilation of the probe included; like compile time, apart from the decode's)."""
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

  def _probes(self, prompts, windows, *, max_new_tokens, sampling, eos_id, pad_id,
              sample_kw, beside=None, again: int = 0) -> list:
    """[(result, seconds per cycle, seconds besides the cycles)] of each window, (tree, k) (tree
    None: the chain of k): what the disk cache kept of it for this model and shape, or measured
    (`_run_probes`, the missing ones together). beside: plain decoding's (cycle, fixed part) as
    the decision has them; windows measured now run beside plain decoding again, scaled by its
    cycle then over now: T and T1 from the same moments (a VM's pace moves between minutes).
    again: n > 0 for the n-th probe again of the same windows (measured anew, its own entry)."""
    width = max(len(p) for p in prompts)
    keys = [self.disk and self._key(
        "probe", params=True, batch=len(prompts), max_new_tokens=max_new_tokens, k=k,
        prompt_bucket=timing_cache.prompt_bucket(width),
        window=f"chain:{k}" if tree is None else tree.name,
        lengths=list(costmodel.probe_lengths(k if tree is None else tree.k, max_new_tokens)),
        rounds=PROBE_ROUNDS,
        sampling={n: v for n, v in sample_kw.items() if n != "seed"} if sampling else None,
        **({"again": again} if again else {})) for tree, k in windows]
    out = [probes_lib.from_entry(self.disk.get(key)) if key else None for key in keys]
    missing = [i for i, o in enumerate(out) if o is None]
    if missing:
      t0 = time.perf_counter()
      got = self._run_probes(prompts, [windows[i] for i in missing] + [(None, 1)] * bool(beside),
                             max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id,
                             pad_id=pad_id, sample_kw=sample_kw)
      self.measured_seconds += time.perf_counter() - t0
      now = got.pop()[1] if beside else 0.0  # plain decoding's cycle, timed beside them again
      scale = beside[0] / now if now > 0 else 1.0
      for i, (r, cycle, fixed) in zip(missing, got):
        cycle, fixed = cycle * scale, fixed * scale
        out[i] = r, cycle, fixed
        if keys[i]:
          self.disk.put(keys[i], probes_lib.to_entry(r, cycle, fixed))
    return out

  def _run_probes(self, prompts, windows, **kw) -> list:
    """`probes.run` of this session's model, PROBE_ROUNDS rounds."""
    return probes_lib.run(self.params, self.args, prompts, windows, rounds=PROBE_ROUNDS, **kw)

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
    # Sampled chains draw their drafts from the heads, where a tree's are the heads' top ranks:
    # a tree's walk does not give a sampled chain's acceptance (it gave 0.79-0.87x the a they had:
    # docs/decoding.md, "Sampled chains beside trees"), so tree=auto probes the chain of k too.
    chains = costmodel.chain(probe.k) if trees and sampling else None
    (r, cycle_seconds, fixed), (_, plain_cycle_seconds, plain_fixed), *rc = self._probes(
        prompts, [(probe if trees else None, probe.k), (None, 1)] + [(None, probe.k)] * bool(
            chains), **kw)  # and plain's loop
    plain = plain_cycle_seconds, plain_fixed
    context = timing_cache.prompt_bucket(width) + max_new_tokens // 2

    one, floor = costmodel.chain(1), costmodel.floor_window(cands)
    timing = dict(batch=batch, context=context)
    times = dict(self.forward_times([one, probe] + [w for w in (floor, chains) if w], **timing))
    # The loops' own cost (acceptance, drafting, cache bookkeeping) beyond the forward: the
    # probes' cycles over the windows' forwards timed in a loop (`costmodel.forward_times`), so
    # T1 is plain decoding's measured step and the probe's window its measured cycle; another
    # candidate's T is the probe's cycle scaled by the two windows' forward times (timed
    # together, one scale). Not clamped at 1: a forward timed slow would pass into T unscaled
    # (docs/decoding.md, "Where auto bets").
    plain_loop_factor = plain_cycle_seconds / times[one]
    own = {probe: (cycle_seconds, fixed)}  # windows whose own loop was measured: (T, F)
    # a window's probe: the chain probe for chains beside trees when sampled, else the first
    src = lambda c: (rc[0][0], chains) if chains and c.k > 1 and not tree_lib.is_tree(c) else (
        r, probe)
    if chains:
      own[chains] = rc[0][1:]
    factor = {w: own[w][0] / times[w] for w in own} | {one: plain_loop_factor}
    seconds = lambda c: (times[one] * plain_loop_factor,
                         own[c][0] if c in own else None if c not in times else
                         times[c] * factor[src(c)[1] if c.k > 1 else one])
    pessimism = dict(max_new_tokens=max_new_tokens)  # the expected slowest row
    # each call's fixed part: plain decoding's from its probe, every candidate's from its probe's
    fixed_of = lambda c: (plain_fixed, own[c][1] if c in own else own[src(c)[1]][1] if c.k > 1
                          else plain_fixed)
    # Only the windows that could win are compiled and timed: a candidate's S is at most its a
    # with the floor window's time (`costmodel.bounds`); under the best S timed so far (or
    # MIN_GAIN) it cannot be chosen.
    a_of = {c: costmodel.predict_a(src(c)[0].rows_hist, src(c)[1], c, **pessimism) for c in cands}
    a_mean_of = {c: costmodel.predict_a(src(c)[0].rows_hist, src(c)[1], c) for c in cands}
    choose = lambda cs, **kw: costmodel.choose(r.rows_hist, probe, cs, seconds, fixed=fixed_of,
                                               a_of=a_of, a_mean_of=a_mean_of, **pessimism, **kw)
    bound = costmodel.bounds(a_of, seconds(floor), fixed=fixed_of, **pessimism) if floor else {}
    so_far = choose([c for c in cands if c in times])["S_predicted"]
    more = [c for c in cands if c not in times and bound[c] >= max(costmodel.MIN_GAIN, so_far)]
    if more:
      times.update(self.forward_times(more, **timing))

    picked = choose(cands, bound=bound)
    # Before betting, the best speculative candidate's own decoding loop is probed (its cycle,
    # fixed part and a over the whole call) where it is the pick or near it, and auto chooses
    # again (probing runners-up too held fewer cells: docs/decoding.md, "Runners-up on their own
    # loop"). A pick on its own loop is probed there once more and chosen on the two probes'
    # mean: a bet on one probe is a bet on its noise (docs/decoding.md, "Bets probed twice").
    # VERIFY_PICKS bounds the candidates probed near the bar, not the checks of a would-be bet.
    readings, verified = {c: [v] for c, v in own.items()}, 0
    for _ in range(BET_PROBES * len(cands)):
      rows = [(row["S_predicted"], c) for row, c in zip(picked["table"], cands)
              if c.k > 1 and row["S_predicted"] is not None]
      top, best = max(rows, key=lambda x: x[0], default=(0.0, None))
      again, bet = len(readings.get(best, ())), top >= costmodel.MIN_GAIN
      if (top < VERIFY_NEAR * costmodel.MIN_GAIN or again >= BET_PROBES or (again and not bet)
          or (not again and not bet and verified >= VERIFY_PICKS)):
        break
      (rb, t_best, f_best), = self._probes(
          prompts, [_loop(best)], **kw, beside=plain,
          again=again)
      readings.setdefault(best, []).append((t_best, f_best))
      own[best] = tuple(float(v) for v in np.mean(readings[best], axis=0))
      if not again:
        verified += 1
        a_of[best], a_mean_of[best] = _own_a(rb.rows_hist, best, pessimism)
      picked = choose(cands, bound=bound)
    for row, c in zip(picked["table"], cands):
      row["own_loop"] = c in own  # T measured on its own loop
      row["probes"] = len(readings.get(c, ()))  # own-loop probes in its T and fixed part
    best = picked.pop("tree")
    if trees:  # the dynamic tree of as many nodes as the best static tree, probed on its own
      picked, best = self._dynamic(prompts, picked, best, k=probe.k, pessimism=pessimism,
                                   floor_seconds=seconds(floor), beside=plain, **kw)
    if HELD_OUT and best.k > 1:
      picked = self._held_out(prompts, picked, best, pessimism=pessimism, beside=plain, **kw)
    spent = time.perf_counter() - t0
    label = ("plain decoding" if best.k == 1 else f"tree {best.name}" if tree_lib.is_tree(best)
             else f"heads 1..{best.k}")
    timed = sum(row["S_predicted"] is not None for row in picked["table"])
    chosen_on = f", chosen on {picked['S_chosen']:.2f}" if "S_chosen" in picked else ""
    self.progress(f"auto: {label} (predicted S {picked['S_predicted']:.2f}{chosen_on}); "
                  f"deciding took {spent:.1f}s, {self.measured_seconds - measured0:.1f}s of it "
                  f"measured; {timed} of {len(picked['table'])} candidates timed, the rest "
                  "could not win")
    return dict(picked, heads=best.k, tree=best if tree_lib.is_tree(best) else None,
                probe={"tree": probe.name, "cycles": int(r.forwards) - 1,
                       "tokens_per_forward": r.tokens_per_forward, "loop_factor": factor[probe],
                       "cycle_seconds": cycle_seconds, "plain_loop_factor": plain_loop_factor,
                       "plain_cycle_seconds": plain_cycle_seconds, "fixed_seconds": fixed,
                       "plain_fixed_seconds": plain_fixed},
                **({"chain_probe": {"tree": chains.name, "cycles": int(rc[0][0].forwards) - 1,
                                    "tokens_per_forward": rc[0][0].tokens_per_forward,
                                    "loop_factor": factor[chains], "cycle_seconds": own[chains][0],
                                    "fixed_seconds": own[chains][1]}} if chains else {}),
                seconds=spent,
                measured_seconds=self.measured_seconds - measured0,  # 0: all from the cache
                cache=self.disk.root if self.disk else None)

  def _dynamic(self, prompts, picked, best, *, k, pessimism, floor_seconds, beside, **kw):
    """`tree=auto`'s dynamic candidate: dynamic:N over heads 2..k, N the node count of the static
    tree of highest predicted S (or bound, where not timed); its a from a probe of its own (the
    slowest row's, smoothed as `costmodel.predict_a` does, from its histogram by depth), its T
    and fixed part its probe's. Probed only where its bound (`costmodel.dynamic_bound`) reaches
    the best S and MIN_GAIN (else its row holds the bound); where the probe says it wins, probed
    again and chosen on the mean of the two (BET_PROBES: a bet on one probe is a bet on its
    noise, docs/decoding.md "Bets probed twice"). (picked, best) again."""
    static = [row for row in picked["table"] if row["nodes"] > row["heads"]]  # not chains
    if not static:
      return picked, best
    s_of = lambda row: row["S_bound"] if row["S_predicted"] is None else row["S_predicted"]
    top = max(static, key=s_of)
    dyn = tree_lib.Dynamic(top["nodes"], k - 1)
    a, bound = costmodel.dynamic_bound(top["a_predicted"], k, floor_seconds, kw["max_new_tokens"],
                                       top["fixed_1_seconds"], top["fixed_seconds"])
    bar = max(costmodel.MIN_GAIN, picked["S_predicted"])
    if bound < bar:
      row = costmodel.table_row(dyn, a, a, top["forward_1_seconds"], None, bound=bound)
      return dict(picked, table=picked["table"] + [row]), best
    probes = self._probes(prompts, [(dyn, k)], beside=beside, **kw)
    a = _own_a(probes[0][0].rows_hist, dyn, pessimism)  # its a: the first probe's
    while True:
      row = costmodel.table_row(  # T and the fixed part: the probes' means
          dyn, *a, top["forward_1_seconds"], float(np.mean([p[1] for p in probes])),
          kw["max_new_tokens"], top["fixed_1_seconds"], float(np.mean([p[2] for p in probes])))
      row["probes"] = len(probes)
      if row["S_predicted"] < bar or len(probes) >= BET_PROBES:
        break
      probes += self._probes(prompts, [(dyn, k)], beside=beside, again=len(probes), **kw)
    picked = dict(picked, table=picked["table"] + [row])
    if row["S_predicted"] >= bar:
      return dict(picked, S_predicted=row["S_predicted"], a_predicted=row["a_predicted"]), dyn
    return picked, best

  def _held_out(self, prompts, picked, best, *, pessimism, beside, **kw) -> dict:
    """A bet's S as one more probe of its own loop reads it, a probe the choice did not use: the
    readings a choice keeps are those that drew high (over 36 bets the cost model read the pick
    log 0.08 high, p = 6e-7, where its own-loop readings of all candidates showed no bias), so
    S_predicted and a_predicted are this probe's (its a, T and fixed part; plain decoding's from
    the decision's probe, this one timed beside it), "S_chosen" the S the choice read, and
    "held_out" the probe's table row. It reports; it does not choose again (a reading that
    chooses is selected: docs/decoding.md, "A reading the choice did not use")."""
    row = next(r for r in picked["table"] if r["tree"] == best.name)
    (r, cycle, fixed), = self._probes(prompts, [_loop(best)], beside=beside,
                                      again=row["probes"], **kw)
    held = costmodel.table_row(best, *_own_a(r.rows_hist, best, pessimism),
                               row["forward_1_seconds"], cycle, kw["max_new_tokens"],
                               row["fixed_1_seconds"], fixed)
    return dict(picked, S_predicted=held["S_predicted"], a_predicted=held["a_predicted"],
                S_chosen=picked["S_predicted"], held_out=held)

  def resolve(self, prompts: list, *, max_new_tokens: int, k, tree, eos_id: int, pad_id: int,
              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0):
    """What `decode` runs for these arguments: (k, Tree or None, the `choose` record or None).
    Checks k and tree (one ValueError naming k or tree); sequential heads fall back from a tree
    to the chain with a logged reason."""
    k, tree = check_window(self.args, k, tree)
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

