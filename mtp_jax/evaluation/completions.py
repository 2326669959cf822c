"""Decoding the completions of pass@k (`generate_completions`: batches of prompts x samples, the
timing cache for heads="auto", a line per batch) and timing the first batch against plain
decoding (`greedy_comparison`), for `mtp_jax.evaluation.passk`."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from mtp_jax.decoding import timing_cache
from mtp_jax.decoding import stops as stops_lib

PROMPT_BUCKET = 64  # prompt lengths are padded up to a multiple of this: few distinct compiles


@dataclasses.dataclass
class Generation:
  tokens: list  # [rows] generated ids per row (EOS included when emitted), rows in input order
  seconds: float = 0.0  # compiled decode time, compilation excluded
  compile_seconds: float = 0.0
  tokens_total: int = 0
  cycles_total: int = 0
  accepted_hist: object = None  # [k] cycles that accepted 0..k-1 drafts, the prompts' rows only,
  # over the batches decoded with the first batch's k
  first_batch: object = None  # DecodeResult of batch 0, for the greedy comparison


def generate_completions(loaded, prompts: list, *, num_samples: int, temperature: float,
                         top_p: float, top_k: int, seed: int, mode: str, max_new_tokens: int,
                         batch_size: int, on_batch=None, stops=(), heads="auto",
                         tree=None, progress=lambda line: None) -> Generation:
  """The one place that calls mtp_jax.decoding.decode. Rows are prompts[i] repeated num_samples
  times, decoded batch_size at a time; k = 1 (greedy) or `heads` (speculative: 1..n_future, None for
  all, or "auto", decided per batch shape; `tree`: a draft tree spec or "auto").

  Each batch is padded to batch_size + 1 rows and its prompt width to a multiple of
  PROMPT_BUCKET by filler rows of pad ids, so the number of compiled programs stays small (the
  decoder compiles once per shape; rows never see each other). on_batch(rows, token_lists) is
  called after each batch with the row indices it decoded. stops: the task's stop sequences; a
  row ends once its cut is decided (decode's in-loop matching, for the byte tokenizer): the
  completion after the cut is the same as if it had decoded max_new_tokens. progress: called with
  a line per batch (rows, tokens/s, ETA) and as auto decides; auto's probes and timings are kept
  in the timing cache (`mtp_jax.decoding.timing_cache`), so a second run decides from it."""
  from mtp_jax.decoding import decode as decode_lib
  from mtp_jax.decoding import tree as tree_lib
  args = loaded.model.args
  tok = loaded.tokenizer
  k, tree = (heads, tree) if mode == "speculative" else (1, None)
  sample_kw = dict(temperature=temperature, top_p=top_p, top_k=top_k)
  table = stops_lib.token_bytes(tok, args.vocab_size) if stops else None
  if table is not None:
    sample_kw["stops"] = stops_lib.build(stops, *table)
  rows = [i for i in range(len(prompts)) for _ in range(num_samples)]
  gen = Generation(tokens=[None] * len(rows))
  session = decode_lib.Session(loaded.params, args, disk=timing_cache.default(),
                               progress=progress)  # "auto" decided once per batch shape
  n_batches, t0 = math.ceil(len(rows) / batch_size), time.monotonic()
  for b, start in enumerate(range(0, len(rows), batch_size)):
    idx = list(range(start, min(start + batch_size, len(rows))))
    batch = [np.asarray(prompts[rows[r]], np.int32) for r in idx]
    width = math.ceil(max(len(p) for p in batch) / PROMPT_BUCKET) * PROMPT_BUCKET
    width = max(min(width, args.max_len - max_new_tokens), max(len(p) for p in batch))
    batch += [np.full(width, tok.pad_id, np.int32)] * (batch_size + 1 - len(idx))
    if temperature > 0:  # one seed per batch: a row's stream must differ between batches
      sample_kw["seed"] = int(np.random.SeedSequence([seed, b]).generate_state(1)[0] >> 1)
    r = session.decode(batch, max_new_tokens=max_new_tokens, k=k, tree=tree,
                       eos_id=tok.eos_id, pad_id=tok.pad_id, **sample_kw)
    n = len(idx)
    out = [r.tokens[j, :r.lengths[j]] for j in range(n)]
    for j, row in enumerate(idx):
      gen.tokens[row] = out[j]
    gen.seconds += r.seconds
    gen.compile_seconds += getattr(r, "compile_seconds", 0.0)
    gen.tokens_total += int(r.lengths[:n].sum())
    gen.cycles_total += int(r.cycles[:n].sum())
    if getattr(r, "rows_hist", None) is not None and getattr(r, "heads", 1) > 1:
      h = tree_lib.by_depth(r.rows_hist[:n].sum(0), r.tree and tree_lib.parse(r.tree), r.heads)
      if gen.accepted_hist is None:
        gen.accepted_hist = h
      elif len(h) == len(gen.accepted_hist):  # a batch whose k (auto, per shape) differs from
        gen.accepted_hist = gen.accepted_hist + h  # the first's (decoding["heads"]) is left out
    if b == 0:
      gen.first_batch = (batch, r, n, getattr(r, "heads", k), dict(sample_kw))
    if on_batch is not None:
      on_batch(idx, out)
    spent = time.monotonic() - t0
    progress(f"batch {b + 1}/{n_batches}: {idx[-1] + 1}/{len(rows)} rows, "
             f"{gen.tokens_total / max(gen.seconds, 1e-9):.0f} tokens/s, ETA "
             f"{spent / (b + 1) * (n_batches - b - 1):.0f}s")
  return gen


def greedy_comparison(loaded, gen: Generation, max_new_tokens: int) -> dict:
  """The first batch decoded again by plain decoding (head 1) and by what the run used, each
  compiled once, warmed up by a call of its own, then timed 3 times interleaved
  (`mtp_jax.decoding.speed`): the median speed-up with its noise band, and whether the tokens agree
  (they must at T = 0)."""
  from mtp_jax.decoding import decode as decode_lib
  from mtp_jax.decoding import speed
  from mtp_jax.decoding import tree as tree_lib
  batch, spec, n, k, sample_kw = gen.first_batch
  tok, args = loaded.tokenizer, loaded.model.args
  shape = dict(batch=len(batch), prompt_len=max(len(p) for p in batch),
               max_new_tokens=max_new_tokens, sampling=sample_kw.get("temperature", 0) > 0)
  tree = None if spec.tree is None else tree_lib.parse(spec.tree)
  sample_kw = dict(sample_kw)
  stops = None if tree is not None else sample_kw.pop("stops", None)  # a tree decodes it all
  sample_kw.pop("stops", None)
  plain = decode_lib.Decoder(loaded.params, args, k=1, stops=stops, **shape)
  used = decode_lib.Decoder(loaded.params, args, k=k, tree=tree, stops=stops, **shape)
  ids = dict(eos_id=tok.eos_id, pad_id=tok.pad_id, **sample_kw)
  timed = speed.time_modes({"plain": lambda: plain(batch, **ids),
                            "used": lambda: used(batch, **ids)})
  g, s = timed["plain"]["result"], timed["used"]["result"]
  cmp = speed.compare(timed["plain"]["seconds"], timed["used"]["seconds"])
  same = (np.array_equal(g.lengths[:n], s.lengths[:n])
          and np.array_equal(g.tokens[:n], s.tokens[:n]))
  return {"rows": n, "heads": k, "tree": spec.tree, "greedy_seconds": cmp["base_seconds"],
          "speculative_seconds": cmp["seconds"], "speedup": cmp["speedup"],
          "speedup_band": cmp["band"], "verdict": cmp["verdict"], "line": speed.line(cmp),
          "tokens_per_forward": float((s.lengths[:n] - 1).sum() / max(s.cycles[:n].sum(), 1)),
          "identical": bool(same) if not sample_kw.get("temperature") else None}
