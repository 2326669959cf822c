"""The compiled decoder: plain and self-speculative decoding of one batch shape with the MTP
heads (Gloeckle et al. 2024 §3.2; Stern et al. 2018; Leviathan et al. 2023), and its result.

One cycle feeds [last accepted token, drafts d_1..d_{k-1}] at positions L..L+k-1 through the
trunk and heads 1..k with a KV cache; head 1 at slot j gives the token for position L+j+1.
Greedy: d_j is accepted while d_j == argmax g_{j-1}, so a row gains m + 1 tokens for m accepted
drafts. Sampling (`mtp_jax.decoding.sampling`): d_j is accepted with probability
min(1, p(d_j) / q_j(d_j)), the first rejection draws from normalise(max(0, p - q)), so the
output is distributed exactly as plain sampling from head 1. Heads 2..k at the last accepted
slot propose the next drafts (rollback by length). k = 1 is plain decoding (docs/decoding.md).

The loop is one jit (`decode_loop.decode_chain`, per-row lengths and EOS); `Decoder` compiles it
for one batch shape. Trees (`tree=`, static or dynamic, greedy or sampled):
`mtp_jax.decoding.tree`. The API over it (k="auto", a fresh session per call):
`mtp_jax.decoding.decode`; the choosing session: `mtp_jax.decoding.session`."""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import acceptance, backends, heads
from mtp_jax.decoding import sampling as sampling_lib
from mtp_jax.decoding import tree as tree_lib
from mtp_jax.decoding.decode_loop import decode_chain
from mtp_jax.model_args import ModelArgs

log = logging.getLogger(__name__)


def check_heads(args: ModelArgs, k: int) -> None:
  if not 1 <= k <= args.n_future:
    raise ValueError(f"k: must be between 1 and the model's n_future ({args.n_future}), got {k}")


def check_window(args: ModelArgs, k, tree):
  """(k, tree) as a decode runs them: k None -> all heads; tree a spec or Tree parsed (a
  dynamic tree over heads 2..k), None where a chain or where the heads cannot run trees (a
  logged reason); "auto" kept for `session.Session.choose`. One ValueError naming k or tree."""
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
  return k, tree


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

