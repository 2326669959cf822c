"""Prediction heads, chosen by `config.model.heads.kind` from a registry.

Every kind maps the trunk state z_BxSxD to h_NxBxSxD, N = n_future: head i (1-based) at
position t predicts x_{t+i}, normalised and ready for the shared unembedding. Head 1 alone is a
next-token model. Heads never produce logits for training: the loss unembeds one head at a time.

A kind is one `HeadKind` subclass under `@register(name)`: its flax `__call__`, and the class
attributes and methods through which the rest of the code sees it (trunk blocks it leaves, KV
cache blocks when decoding, which stacked params hold which head, its own config fields). Nothing
outside this module names a kind.

Transformed modules (nn.vmap / nn.scan) only touch their own parameters; shared arrays (the
final norm scale, the embedding table) come in as plain arguments, so lifting stays simple.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.layers import Block, RMSNorm, dense_init, remat, rms_norm
from mtp_jax.model_args import ModelArgs

KINDS: dict[str, type["HeadKind"]] = {}


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
  # Decoding: what sequential depths read (`DecodeReads`); None: head 1's argmax, then each
  # depth's argmax.
  reads: Any = None


@dataclasses.dataclass(frozen=True)
class DecodeReads:
  """What the sequential depths read while decoding, given by the decoder (mtp_jax.sampling).

  known(h1_BxSxD, depths) -> [depths, B, S] int: the token depth d reads at position s, x_{s+d},
  where the decoder knows it (the prompt; the accepted drafts and the new token of a cycle), -1
  elsewhere. draft(xs_d, out_BxSxD) -> [B, S]: depth d's draft from its normalised output, what
  depth d + 1 reads where nothing is known. xs: per-depth inputs of `draft` (leading axis
  n_future - 1) or None."""
  known: Callable
  draft: Callable
  xs: Any = None


class HeadKind(nn.Module):
  """Base of every head kind. The module: (z_BxSxD, Shared, cache) -> (h_NxBxSxD, new cache).

  Class attributes a kind sets:
    stacks: {name of a stacked param subtree under params["heads"]: `first`, the head that
      its index 0 holds}; index i holds head first + i. Slicing to the first k heads (the
      decoder) and finding head j's params (a converter) read only this: `slice_params`,
      `head_params`.
    choices: {field of config.model.heads that this kind reads: its allowed values}. Checked
      whichever kind is chosen, so a typo in a saved config fails at start-up.
    preset_field, presets: an optional field naming a preset, and {preset: {field: value}};
      `validation.expand_presets` sets its fields (validate checks that a field set by hand
      agrees with the preset or is at its default).
  """
  args: ModelArgs

  # Class attributes, not dataclass fields (no annotations): flax would make them fields.
  kind = ""  # set by `register`
  stacks = {}
  choices = {}
  preset_field = ""
  presets = {}

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


@register("parallel")
class ParallelHeads(HeadKind):
  """Gloeckle et al. 2024 §2 and Meta's released layout: n_future transformer blocks (head 1 is
  the last block of an n_layers-deep next-token model) with stacked params, applied by nn.vmap
  to the same trunk state (before the final norm), then one shared final norm. Each head block
  keeps its own KV cache when decoding."""
  stacks = {"blocks": 1}
  # "vmap" runs the head blocks side by side; "scan" one at a time (same params).
  choices = {"parallel_stack": ("vmap", "scan")}

  @classmethod
  def n_trunk(cls, m) -> int:
    return m.n_layers - m.n_future  # matched parameters: the heads take the last blocks

  @classmethod
  def cache_blocks(cls, args: ModelArgs) -> int:
    return args.n_future

  @classmethod
  def warm_start(cls, fresh: dict, args: ModelArgs) -> None:
    """Every extra head block starts as a copy of head 1's (Meta's layout: the last layer)."""
    for x in jax.tree.leaves(fresh["blocks"]):
      x[1:] = x[0]

  @classmethod
  def validate_config(cls, m, fail) -> None:
    if m.n_future > m.n_layers:
      fail("model.n_future", f"parallel heads take their blocks from the trunk, so n_future "
           f"must be <= model.n_layers ({m.n_layers}), got {m.n_future}")

  @nn.compact
  def __call__(self, z_BxSxD, s: Shared, cache=None):
    a = self.args
    lifted = dict(variable_axes={"params": 0}, split_rngs={"params": True},
                  metadata_params={nn.PARTITION_NAME: "mtp_heads"})
    if a.parallel_stack == "vmap":
      blocks = nn.vmap(remat(Block, a.remat_policy), in_axes=(None, None, None, 0), out_axes=0,
                       axis_size=a.n_future, **lifted)
      h_NxBxSxD, new_cache = blocks(a, name="blocks")(z_BxSxD, s.positions_BxS,
                                                      s.segment_ids_BxS, cache)
    else:  # same parameter layout, one head block alive at a time

      def one_head(block, carry, head_cache):
        h_BxSxD, c = block(z_BxSxD, s.positions_BxS, s.segment_ids_BxS, head_cache)
        return carry, (h_BxSxD, c)

      scan = nn.scan(one_head, in_axes=0, length=a.n_future, **lifted)
      _, (h_NxBxSxD, new_cache) = scan(remat(Block, a.remat_policy)(a, name="blocks"), None,
                                       cache)
    return rms_norm(h_NxBxSxD, s.norm_D, a.norm_eps), new_cache


class ResidualMLP(nn.Module):
  """Seed 000's light head: z + Linear(2d, d)(SiLU(Linear(d, 2d)(RMSNorm(z))))."""
  args: ModelArgs

  @nn.compact
  def __call__(self, z_BxSxD):
    a = self.args
    y = RMSNorm(a.norm_eps, a.dtype, name="norm")(z_BxSxD)
    y = nn.Dense(2 * a.d_model, use_bias=False, dtype=a.dtype,
                 kernel_init=dense_init(("embed", "mlp")), name="up")(y)
    y = nn.Dense(a.d_model, use_bias=False, dtype=a.dtype,
                 kernel_init=dense_init(("mlp", "embed")), name="down")(nn.silu(y))
    return z_BxSxD + y


@register("projection")
class ProjectionHeads(HeadKind):
  """Head 1 is the trunk itself; heads 2..n are residual MLPs (vmapped, stacked params) on the
  trunk state; all heads share the final norm and the unembedding. No attention, no cache."""
  stacks = {"mlps": 2}

  @classmethod
  def warm_start(cls, fresh: dict, args: ModelArgs) -> None:
    """Zero output projections: every extra head starts as the identity on the trunk state."""
    fresh["mlps"]["down"]["kernel"][...] = 0

  @nn.compact
  def __call__(self, z_BxSxD, s: Shared, cache=None):
    a = self.args
    h_NxBxSxD = z_BxSxD[None]
    if a.n_future > 1:
      mlps = nn.vmap(ResidualMLP, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=None, out_axes=0, axis_size=a.n_future - 1,
                     metadata_params={nn.PARTITION_NAME: "mtp_heads"})
      h_NxBxSxD = jnp.concatenate([h_NxBxSxD, mlps(a, name="mlps")(z_BxSxD)], axis=0)
    return rms_norm(h_NxBxSxD, s.norm_D, a.norm_eps), cache


class Depth(nn.Module):
  """One DeepSeek-V3 MTP module (arXiv 2412.19437 eq. 21-23), scanned over depths k = 1..n-1:
  h'_k = eh_proj([enorm(Emb(x_{t+k})); hnorm(h_{k-1})]), h_k = Block(h'_k), and
  P_{k+1} = unembed(out_norm(h_k)). The concatenation order, the output norm (own
  `shared_head_norm` or the main one) are config fields; see SequentialHeads.presets for who
  does which.

  Teacher forcing (training): the depth's token embeddings come in as the scanned input.
  Decoding (`Shared.decoding`): the scanned input is (known_BxS, xs): depth k reads the known
  token x_{t+k} where the decoder has it (`DecodeReads.known`: prompt, accepted tokens), else
  the draft of depth k-1 at the same position, so one forward drafts n-1 chained tokens at the
  last accepted position."""
  args: ModelArgs

  @nn.compact
  def __call__(self, carry, emb_BxSxD, cache, s: Shared):
    a = self.args
    h_prev_BxSxD, tok_BxS = carry
    if s.decoding:
      known_BxS, xs = emb_BxSxD
      tok_BxS = jnp.where(known_BxS >= 0, known_BxS, tok_BxS)
      emb_BxSxD = jnp.take(s.embed_VxD, tok_BxS, axis=0).astype(a.dtype)
    e = RMSNorm(a.norm_eps, a.dtype, name="enorm")(emb_BxSxD)
    h = RMSNorm(a.norm_eps, a.dtype, name="hnorm")(h_prev_BxSxD)
    cat = [e, h] if a.seq_concat == "emb_first" else [h, e]
    x_BxSxD = nn.Dense(a.d_model, use_bias=False, dtype=a.dtype,
                       kernel_init=dense_init(("concat", "embed")),
                       name="eh_proj")(jnp.concatenate(cat, axis=-1))
    h_BxSxD, new_cache = remat(Block, a.remat_policy)(a, name="block")(
        x_BxSxD, s.positions_BxS, s.segment_ids_BxS, cache)
    if a.seq_output_norm == "per_module":
      out_BxSxD = RMSNorm(a.norm_eps, a.dtype, name="shared_head_norm")(h_BxSxD)
    else:
      out_BxSxD = rms_norm(h_BxSxD, s.norm_D, a.norm_eps)
    if s.decoding:
      if s.reads is None:
        tok_BxS = jnp.argmax(out_BxSxD.astype(jnp.float32) @ s.unembed_DxV, axis=-1)
      else:
        tok_BxS = s.reads.draft(xs, out_BxSxD)
      tok_BxS = tok_BxS.astype(jnp.int32)
    return (h_BxSxD, tok_BxS), (out_BxSxD, new_cache)


def shift_left(x_BxSx_, k: int):
  """x[:, t + k] at position t, zeros past the end (those positions have no target)."""
  pad = jnp.zeros_like(x_BxSx_[:, :k])
  return jnp.concatenate([x_BxSx_[:, k:], pad], axis=1)


@register("sequential")
class SequentialHeads(HeadKind):
  """DeepSeek-V3 MTP: head 1 is the trunk (final norm + shared unembedding); depths 1..n-1 are
  a causal chain of `Depth` modules, nn.scan over stacked params. Depth k at position t sees
  x_{<=t+k} and predicts x_{t+k+1}, i.e. it is head k+1.

  Where public implementations disagree, a config field chooses (`presets` names who does
  which): the concatenation order, the trunk state before or after the final norm, and each
  depth's own output norm or the main one."""
  stacks = {"depths": 2}
  choices = {"seq_concat": ("emb_first", "hidden_first"),
             "seq_trunk_state": ("post_norm", "pre_norm"),
             "seq_output_norm": ("per_module", "shared")}
  preset_field = "seq_preset"
  presets = {
      # The released DeepSeek-V3 weights, Megatron, vLLM, SGLang: eh_proj([enorm(emb);
      # hnorm(h)]), h taken after the main model's final norm, `shared_head.norm` per module.
      "deepseek_v3": dict(seq_concat="emb_first", seq_trunk_state="post_norm",
                          seq_output_norm="per_module"),
      # The paper's eq. 21 ([h; emb]) as MiMo writes it.
      "paper": dict(seq_concat="hidden_first", seq_trunk_state="post_norm",
                    seq_output_norm="per_module"),
      # MaxText: trunk state before the final norm, the main model's norm reused for every
      # depth.
      "maxtext": dict(seq_concat="emb_first", seq_trunk_state="pre_norm",
                      seq_output_norm="shared"),
  }

  @classmethod
  def warm_start(cls, fresh: dict, args: ModelArgs) -> None:
    """Each depth's block adds nothing (zero attention and MLP output projections) and eh_proj
    passes the previous hidden state through, so depth k starts out predicting what head 1
    predicts, not noise."""
    d = fresh["depths"]
    d["block"]["attention"]["wo"]["kernel"][...] = 0
    d["block"]["feed_forward"]["w2"]["kernel"][...] = 0
    eh = d["eh_proj"]["kernel"]  # [depths, 2D, D]: rows of [emb; h] or [h; emb]
    eh[...] = 0
    h_rows = slice(args.d_model, None) if args.seq_concat == "emb_first" else slice(0, args.d_model)
    eh[:, h_rows] = np.eye(args.d_model, dtype=eh.dtype)

  @classmethod
  def cache_blocks(cls, args: ModelArgs) -> int:
    return args.n_future - 1

  @nn.compact
  def __call__(self, z_BxSxD, s: Shared, cache=None):
    a = self.args
    h1_BxSxD = rms_norm(z_BxSxD, s.norm_D, a.norm_eps)
    if a.n_future == 1:
      return h1_BxSxD[None], cache
    h0_BxSxD = h1_BxSxD if a.seq_trunk_state == "post_norm" else z_BxSxD
    D = a.n_future - 1
    tok_BxS = jnp.zeros(z_BxSxD.shape[:2], jnp.int32)
    if s.decoding and s.reads is None:  # depth 1 reads head 1's argmax, deeper depths drafts
      first_BxS = jnp.argmax(h1_BxSxD.astype(jnp.float32) @ s.unembed_DxV, axis=-1)
      known_DxBxS = jnp.full((D,) + tok_BxS.shape, -1, jnp.int32).at[0].set(first_BxS)
      emb_DxBxSxD = (known_DxBxS, None)
    elif s.decoding:
      emb_DxBxSxD = (s.reads.known(h1_BxSxD, D), s.reads.xs)
    else:
      emb_DxBxSxD = jnp.stack([shift_left(s.x_BxSxD, k) for k in range(1, D + 1)])
    depths = nn.scan(Depth, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=(0, 0, nn.broadcast), length=D,
                     metadata_params={nn.PARTITION_NAME: "mtp_heads"})
    _, (out_DxBxSxD, new_cache) = depths(a, name="depths")(
        (h0_BxSxD.astype(a.dtype), tok_BxS), emb_DxBxSxD, cache, s)
    return jnp.concatenate([h1_BxSxD[None], out_DxBxSxD.astype(h1_BxSxD.dtype)]), new_cache
