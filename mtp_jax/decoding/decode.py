"""Greedy and sampled decoding, plain and self-speculative with the MTP heads: the API.

`decode` / `resolve` / `choose` with a fresh `Session` per call; `plain`, `repeat`. What they
run: `decoder.Decoder` (one compiled batch shape, chain or tree; `DecodeResult`), chosen by
`session.Session` (k="auto" / tree="auto" by the cost model, `mtp_jax.decoding.costmodel`, once
per shape). Those names are re-exported here, so `decode.Decoder`, `decode.Session` and the rest
keep working (docs/decoding.md)."""

from __future__ import annotations

from mtp_jax.decoding import costmodel  # noqa: F401  (decode.costmodel: the cost model)
from mtp_jax.decoding.costmodel import PROBE_CYCLES, forward_seconds  # noqa: F401  (its inputs)
from mtp_jax.decoding.decode_loop import Accepted, accept_greedy, decode_chain, gain  # noqa: F401
from mtp_jax.decoding.decoder import (  # noqa: F401  (re-exported)
    DecodeResult, Decoder, check_heads, slice_heads)
from mtp_jax.decoding.session import CACHE_SIZE, Session  # noqa: F401
from mtp_jax.model_args import ModelArgs


def choose(params, args: ModelArgs, prompts: list, disk=None, **kw) -> dict:
  """`Session.choose` with a fresh session (disk: its `timing_cache.DiskCache`, or None)."""
  return Session(params, args, disk=disk).choose(prompts, **kw)


def resolve(params, args: ModelArgs, prompts: list, disk=None, **kw):
  """`Session.resolve` with a fresh session (disk: its `timing_cache.DiskCache`, or None)."""
  return Session(params, args, disk=disk).resolve(prompts, **kw)


def decode(params, args: ModelArgs, prompts: list, disk=None, **kw) -> DecodeResult:
  """`Session.decode` with a fresh session (k="auto" decides anew, unless `disk`, a
  `timing_cache.DiskCache`, kept what it measures: keep a `Session` to decide once per shape
  over many calls)."""
  return Session(params, args, disk=disk).decode(prompts, **kw)


def plain(params, args: ModelArgs, prompts: list, **kw) -> DecodeResult:
  """Plain decoding with head 1 alone (k = 1), the baseline: greedy, or sampled (temperature)."""
  return decode(params, args, prompts, k=1, **kw)


def repeat(prompts: list, num_samples: int) -> list:
  """Each prompt num_samples times in a row (rows i * num_samples + s, s < num_samples): the
  batch that draws num_samples independent samples of every prompt (pass@k)."""
  if not isinstance(num_samples, int) or num_samples < 1:
    raise ValueError(f"num_samples: must be an integer >= 1, got {num_samples!r}")
  return [p for p in prompts for _ in range(num_samples)]
