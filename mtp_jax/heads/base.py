"""The head-kind registry and what every kind shares: `HeadKind` (the base module and the hooks
through which the rest of the code sees a kind), `Shared` (what a kind reads besides the trunk
state), `Drafting` (what the decoder gives heads 2..k in a decoding forward's second phase) and
`slice_params`.

Every kind maps the trunk state z_BxSxD to h_NxBxSxD, N = n_future: head i (1-based) at
position t predicts x_{t+i}, normalised and ready for the shared unembedding. Head 1 alone is a
next-token model. Heads never produce logits for training: the loss unembeds one head at a time.

Transformed modules (nn.vmap / nn.scan) only touch their own parameters; shared arrays (the
final norm scale, the embedding table) come in as plain arguments, so lifting stays simple.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtp_jax.layers import init_cache
from mtp_jax.model_args import ModelArgs

KINDS: dict[str, type[HeadKind]] = {}


def register(name: str) -> Callable:
  """Class decorator: makes a `HeadKind` subclass `config.model.heads.kind = name`."""
  def wrap(cls):
    if name in KINDS:
      raise ValueError(f"head kind {name!r} is already registered")
    cls.kind = name
    KINDS[name] = cls
    return cls
  return wrap


def unregister(name: str) -> None:
  del KINDS[name]


@dataclasses.dataclass(frozen=True)
class Shared:
  """What every head kind may read besides the trunk state. Arrays, not modules."""
  x_BxSxD: jax.Array  # input embeddings (sequential depths shift them for teacher forcing)
  positions_BxS: jax.Array
  segment_ids_BxS: Any  # None or int [B, S]
  norm_D: jax.Array  # the shared final RMSNorm scale
  embed_VxD: jax.Array
  unembed_DxV: jax.Array
  # Decoding, not teacher forcing: the next tokens are unknown, so a kind that reads them
  # (sequential depths) reads its own drafts instead.
  decoding: bool = False
  # A decoding forward in two phases (the decoder's, mtp_jax.decoding): "first", the trunk and
  # head 1 (each kind returns head 1's states [1, B, S, D] and its cache with head 1's part
  # written); the decoder reads head 1 and decides what it accepts; "rest", heads 2..k from the
  # trunk state (each kind returns their states [k - 1, B, S, D] and the cache with their part
  # written), reading what `drafting` says. None: every head in one forward. A kind that
  # ignores the phase still decodes right (MTPModel keeps the heads each phase asks for), its
  # heads run twice.
  phase: str | None = None
  drafting: Any = None  # `Drafting` (phase "rest"); None: sequential depths draft by argmax


def head_logits(h_BxSxD, unembed_DxV) -> jax.Array:
  """f32 logits of one head's states: the same op wherever a token is drawn from them, so the
  sequential chain (heads/sequential.py) and the decoder (mtp_jax.decoding) draw the same draft
  from the same uniform."""
  return jnp.einsum("bsd,dv->bsv", h_BxSxD, unembed_DxV.astype(h_BxSxD.dtype),
                    preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Drafting:
  """What heads 2..k read in the second phase of a decoding forward (`Shared.phase` "rest"),
  given by the decoder after it has read head 1 and decided what the cycle accepts. Data, and
  the decoder's draw; no call back into the decoder.

  slot_B [B]: the window position at which the decoder reads heads 2..k (the last accepted one;
  prefill: the prompt's last). Parallel heads run their full block there alone and only write
  their keys and values elsewhere (their states hold the slot's at every position).
  after_BxS [B, S] or None: the token after each window position where the decoder knows it
  (positions <= slot: the prompt; the accepted drafts and the cycle's new token); sequential
  depth d reads x_{s+d} there (`known_tokens`), its own drafts beyond.
  pick: None (sequential depths draft by argmax) or pick(logits_xV, u_x) -> tokens, the
  decoder's draw with the row's uniform u_DxB[d - 1] for depth d. slots_BxN: the only window
  positions where a depth drafts (prefill: the prompt's last n_future - 1), or None.
  unembed_DxV: the unembedding drafts are drawn with, the loop's own, taken once before the
  loop (inside it XLA:CPU would transpose a tied embedding again every cycle: 113 MB for a
  49,152-token vocabulary); None: the model's."""
  slot_B: jax.Array
  after_BxS: Any = None
  pick: Callable | None = None
  u_DxB: Any = None
  slots_BxN: Any = None
  unembed_DxV: Any = None


PHASES = (None, "first", "rest")


class HeadKind(nn.Module):
  """Base of every head kind. The module: (z_BxSxD, Shared, cache) -> (h_NxBxSxD, new cache);
  with `Shared.phase` "first" head 1 alone, "rest" heads 2..k alone (h_1xBxSxD, h_{N-1}xBxSxD).

  Class attributes a kind sets:
    stacks: {name of a stacked param subtree under params["heads"]: `first`, the head that
      its index 0 holds}; index i holds head first + i. Slicing to the first k heads (the
      decoder) and finding head j's params (a converter) read only this: `slice_params`,
      `head_params`.
    choices: {field of config.model.heads that this kind reads: its allowed values}. Checked
      whichever kind is chosen, so a typo in a saved config fails at start-up.
    preset_field, presets: an optional field naming a preset, and {preset: {field: value}};
      `preset_values` reads them, `config.validation.expand_presets` sets them (validate
      checks that a field set by hand agrees with the preset or is at its default).
    drafts_tree: whether its heads 2..k can draft a tree of candidates (each reads only the
      trunk state, so every node of a depth chooses among the same candidates); False: a chain.
    checkpoint_layouts: {released layout ("meta", "deepseek"): {field of config.model.heads:
      value}}: the layouts whose heads this kind holds, and the fields (a preset, or fields one
      by one) a model needs to hold them. The converters ask `layout_kind`.
  """
  args: ModelArgs

  # Class attributes, not dataclass fields (no annotations): flax would make them fields.
  kind = ""  # set by `register`
  stacks = {}
  choices = {}
  preset_field = ""
  presets = {}
  drafts_tree = False
  checkpoint_layouts = {}

  @classmethod
  def layout_fields(cls, layout: str) -> dict:
    """The config.model.heads fields (a preset expanded) a model of this kind needs to hold
    `layout`'s heads."""
    out = {}
    for field, value in cls.checkpoint_layouts[layout].items():
      out.update(cls.presets[value] if field == cls.preset_field else {field: value})
    return out

  @classmethod
  def n_trunk(cls, m) -> int:
    """Trunk blocks of a model with config.model `m` (by default all n_layers)."""
    return m.n_layers

  @classmethod
  def cache_blocks(cls, args: ModelArgs) -> int:
    """Attention blocks in the heads that need their own KV cache when decoding."""
    del args
    return 0

  @classmethod
  def validate_fields(cls, h, defaults, fail: Callable[[str, str], None]) -> None:
    """Checks config.model.heads `h` without changing it: a field the preset sets must be at
    the preset's value or at its default, and each field (as the preset sets it) in `choices`.
    `fail(field, message)` raises."""
    preset = h[cls.preset_field] if cls.preset_field else ""
    if preset and preset not in cls.presets:
      fail(f"model.heads.{cls.preset_field}", f"got {preset!r}, allowed: '' or "
           + ", ".join(map(repr, cls.presets)))
    for field, value in cls.presets.get(preset, {}).items():
      if h[field] not in (value, defaults[field]):
        fail(f"model.heads.{cls.preset_field}", f"preset {preset!r} sets {field} = {value!r}, "
             f"but {field} = {h[field]!r} was asked for; set {cls.preset_field}='' to choose "
             "the fields one by one")
    for field, allowed in cls.choices.items():
      value = cls.presets.get(preset, {}).get(field, h[field])
      if value not in allowed:
        fail(f"model.heads.{field}", f"got {value!r}, allowed: "
             + ", ".join(map(repr, allowed)))

  @classmethod
  def validate_config(cls, m, fail: Callable[[str, str], None]) -> None:
    """Checks on config.model `m` that hold when this kind is chosen."""

  @classmethod
  def head_params(cls, j: int) -> list[tuple[tuple[str, ...], int]]:
    """Where head j's own params sit: (path in the param tree, index on the stacked axis) for
    every stack holding it; [] for a head with no params of its own (the trunk's head 1)."""
    return [(("heads", name), j - first) for name, first in cls.stacks.items() if j >= first]

  @classmethod
  def warm_start(cls, fresh: dict, args: ModelArgs) -> None:
    """Adding heads to a pretrained next-token model (convert from-hf, --init_heads copy):
    edits the freshly initialised params["heads"] (numpy, in place) so the new heads start
    close to head 1. Head 1's own params, if any, are filled in by the converter. Default:
    keep the fresh initialisation."""

  @classmethod
  def flops_per_token(cls, m, block: int) -> tuple[int, int]:
    """(forward matmul FLOPs per token of the heads' own weights, attention blocks in the
    heads) for config.model `m`; `block` is one Llama block's matmul FLOPs per token (attention
    scores aside). flops.py adds the trunk, attention scores and the unembedding (as levanter's
    LmConfig.flops_per_token)."""
    raise NotImplementedError(f"head kind {cls.kind!r} does not count its FLOPs "
                              "(HeadKind.flops_per_token)")

  @classmethod
  def decode_layout(cls, params, args: ModelArgs):
    """(params, args) of the same model laid out for a decoding loop (`model.unrolled`, once
    before the loop: XLA:CPU slices stacked weights again in every iteration). Default: as is."""
    return params, args

  @classmethod
  def decode_cache(cls, args: ModelArgs, batch: int, length: int, dtype):
    """The heads' zeroed KV caches (`model.init_decode_cache`): leaves [blocks, B, K, L, E],
    `cache_blocks` of them stacked by default; None without attention blocks."""
    n = cls.cache_blocks(args)
    return init_cache(args, n, batch, length, dtype) if n else None

def layout_kind(layout: str) -> type[HeadKind]:
  """The kind whose heads a released checkpoint layout ("meta", "deepseek") holds."""
  found = [kind for kind in KINDS.values() if layout in kind.checkpoint_layouts]
  if len(found) != 1:
    raise ValueError(f"checkpoint layout {layout!r}: held by {len(found)} head kinds, not one")
  return found[0]


def preset_values(h) -> dict[str, Any]:
  """{field: value} that the chosen presets of config.model.heads `h` set (every kind's preset
  field, whichever kind is chosen, as validation checks them)."""
  out = {}
  for kind in KINDS.values():
    if kind.preset_field:
      out.update(kind.presets.get(h[kind.preset_field], {}))
  return out


def tree_kinds() -> tuple[str, ...]:
  """The kinds whose heads draft trees (`HeadKind.drafts_tree`), in registration order."""
  return tuple(name for name, kind in KINDS.items() if kind.drafts_tree)


def slice_params(params, kind: type[HeadKind], k: int):
  """The param tree restricted to heads 1..k: each stack cut to the heads <= k it holds."""
  heads = dict(params.get("heads", {}))
  for name, first in kind.stacks.items():
    n = k - first + 1
    if name not in heads:
      continue
    if n <= 0:
      del heads[name]
    else:
      heads[name] = jax.tree.map(lambda x, n=n: x[:n], heads[name])
  params = dict(params)
  if heads:
    params["heads"] = heads
  else:
    params.pop("heads", None)
  return params
