"""The MTP transformer: embedding, trunk (nn.scan + nn.remat over blocks), and a head kind from
the registry in `heads/`. `apply` returns per-head hidden states h_NxBxSxD (normalised) and,
when decoding, the updated KV cache; never the logits of all heads at once. The loss (and the
decoder) unembed with `unembedding(params, args)`.

The vocabulary is padded to `args.padded_vocab` rows (model.vocab_multiple) so that it splits
over a mesh axis and fills the matrix units; pad ids never win: `mask_pad_logits` gives them
-inf in the loss; `logits` and the heads' decoding drafts see the real columns only.

Gloeckle et al. 2024 §2: z = f_s(x), h_i = f_{h_i}(z), p_i = softmax(f_u(h_i)).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from mtp_jax import backends
from mtp_jax import heads
from mtp_jax.model_args import ModelArgs
from mtp_jax.layers import Block, embed_lookup, init_cache, norm_param, remat


def trunk_unroll(a: ModelArgs) -> int:
  """Layers per iteration of the scanned trunk: model.scan_unroll, or for 0 (auto) the backend's
  choice (all of them on one CPU device, one elsewhere; static: called while tracing)."""
  if a.scan_unroll:
    return min(a.scan_unroll, a.n_trunk)
  return backends.current().trunk_unroll_auto(a)


class Trunk(nn.Module):
  """`args.n_trunk` pre-norm blocks. With scan_layers, params are stacked on a leading `layers`
  axis and compile time stays flat in depth; otherwise an unrolled loop (same maths, used by the
  scan-equals-unrolled test)."""
  args: ModelArgs

  @nn.compact
  def __call__(self, x_BxSxD, positions_BxS, segment_ids_BxS=None, cache=None):
    a = self.args
    if a.n_trunk == 0:
      return x_BxSxD, cache
    block = remat(Block, a.remat_policy)
    if a.scan_layers:
      stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, nn.broadcast, 0), length=a.n_trunk,
                      unroll=trunk_unroll(a),
                      metadata_params={nn.PARTITION_NAME: "layers"})
      return stack(a, name="layers")(x_BxSxD, positions_BxS, segment_ids_BxS, cache)
    per_layer = isinstance(cache, list)  # init_decode_cache's layout for an unrolled trunk
    new_caches = []
    for i in range(a.n_trunk):
      if cache is None:
        layer_cache = None
      elif per_layer:  # [1, B, K, L, E] leaves: dropping the axis is free
        layer_cache = jax.tree.map(lambda c: c[0], cache[i])
      else:
        layer_cache = jax.tree.map(lambda c, i=i: c[i], cache)
      x_BxSxD, c = block(a, name=f"layers_{i}")(x_BxSxD, positions_BxS, segment_ids_BxS,
                                                layer_cache)
      if per_layer:
        new_caches.append(jax.tree.map(lambda n: n[None], c))
      elif cache is not None:  # written back in place (a stack would copy the whole cache)
        cache = jax.tree.map(lambda old, new, i=i: old.at[i].set(new), cache, c)
    return x_BxSxD, new_caches if per_layer else cache


class MTPModel(nn.Module):
  """tokens_BxS -> (h_NxBxSxD, cache). Pass `cache` (from `init_decode_cache`) and absolute
  `positions_BxS` to decode; `decoding=True` (no teacher forcing: heads that would read the
  next tokens, sequential depths, read their own drafts). A decoding loop runs the forward in
  two phases (`heads.Shared.phase`, mtp_jax.decoding.forward): phase "first" returns
  ((h_1xBxSxD, z_BxSxD), cache), head 1 and the trunk's output, the trunk's cache written;
  phase "rest" takes that z as `trunk_states_BxSxD` and `drafting` (a `heads.Drafting`) and
  returns (h_{N-1}xBxSxD, cache), heads 2..N. `trunk_states_BxSxD` without a cache: the trunk's
  output, computed before (heads-only training on a frozen trunk computes it once per window,
  experiments/smollm2_heads.py); the trunk is skipped, the heads read it as they read the
  trunk's."""
  args: ModelArgs

  @nn.compact
  def __call__(self, tokens_BxS, segment_ids_BxS=None, positions_BxS=None, cache=None, *,
               embeddings_BxSxD=None, decoding: bool = False, phase: str | None = None,
               drafting=None, trunk_states_BxSxD=None):
    a = self.args
    B, S = tokens_BxS.shape
    if positions_BxS is None:
      positions_BxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    embed = nn.Embed(a.padded_vocab, a.d_model, dtype=a.dtype, name="embed",
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(0.02), ("vocab", "embed")))
    if embeddings_BxSxD is None:
      x_BxSxD = embed_lookup(embed.embedding, tokens_BxS, a.dtype)
    else:
      x_BxSxD = embeddings_BxSxD
    if phase not in heads.PHASES:
      raise ValueError(f"phase: got {phase!r}, allowed: {heads.PHASES}")
    if (phase == "rest") != (trunk_states_BxSxD is not None and cache is not None):
      raise ValueError("trunk_states_BxSxD with a decoding cache: phase 'rest' alone, which "
                       "needs both (the first phase's trunk output and cache)")
    if trunk_states_BxSxD is None:
      z_BxSxD, trunk_cache = Trunk(a, name="trunk")(
          x_BxSxD, positions_BxS, segment_ids_BxS, None if cache is None else cache["trunk"])
    else:  # the trunk already ran (phase "rest": its cache is written)
      z_BxSxD, trunk_cache = trunk_states_BxSxD, None if cache is None else cache["trunk"]
    if a.tie_embeddings:
      unembed_DxV = embed.embedding.T
    else:
      unembed_DxV = self.param("unembed", nn.with_logical_partitioning(
          nn.initializers.normal(a.d_model ** -0.5), ("embed", "vocab")),
                               (a.d_model, a.padded_vocab), jnp.float32)
    # Heads argmax over Shared.unembed_DxV when drafting (sequential depths): the real columns
    # only, so a pad id is never a draft (unused, hence compiled away, in training).
    shared = heads.Shared(x_BxSxD=x_BxSxD, positions_BxS=positions_BxS,
                          segment_ids_BxS=segment_ids_BxS,
                          norm_D=norm_param(self, "norm", a.d_model), embed_VxD=embed.embedding,
                          unembed_DxV=unembed_DxV[:, :a.vocab_size], decoding=decoding,
                          phase=phase, drafting=drafting)
    h_NxBxSxD, head_cache = heads.KINDS[a.head_kind](a, name="heads")(
        z_BxSxD, shared, None if cache is None else cache["heads"])
    new_cache = None if cache is None else {"trunk": trunk_cache, "heads": head_cache}
    if phase is not None and a.n_future > 1 and h_NxBxSxD.shape[0] == a.n_future:
      # a kind that ignores `phase` (every head in each phase: right, its heads run twice)
      h_NxBxSxD = h_NxBxSxD[:1] if phase == "first" else h_NxBxSxD[1:]
    if phase == "first":
      return (h_NxBxSxD, z_BxSxD), new_cache
    return h_NxBxSxD, new_cache


def trunk_states(params, args: ModelArgs, tokens_BxS, segment_ids_BxS=None) -> jax.Array:
  """The trunk's output z_BxSxD for `tokens_BxS` (what `MTPModel` passes its heads), to be
  given back as `trunk_states_BxSxD`: heads trained on a frozen trunk compute it once."""
  B, S = tokens_BxS.shape
  x_BxSxD = embed_lookup(params["embed"]["embedding"], tokens_BxS, args.dtype)
  positions_BxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  if args.n_trunk == 0:
    return x_BxSxD
  z_BxSxD, _ = Trunk(args).apply({"params": params["trunk"]}, x_BxSxD, positions_BxS,
                                 segment_ids_BxS)
  return z_BxSxD


def model_args(config: ml_collections.ConfigDict) -> ModelArgs:
  """The ModelArgs of a config that an entry point has checked (`mtp_jax.config.validation.
  resolve`; not checked again here): its head kind's presets expanded, n_trunk from the kind,
  dtype a jnp dtype."""
  m = config.model
  if m.heads.kind not in heads.KINDS:  # the registry lookup below: say what is wrong
    raise ValueError(f"config.model.heads.kind: got {m.heads.kind!r}, allowed: "
                     f"{', '.join(map(repr, heads.KINDS))} (check a config with "
                     "mtp_jax.config.validation.resolve)")
  return ModelArgs.from_config(m, n_trunk=heads.KINDS[m.heads.kind].n_trunk(m),
                               dtype=jnp.dtype(m.dtype), **heads.preset_values(m.heads))


def build_model(config: ml_collections.ConfigDict | ModelArgs) -> MTPModel:
  """The (unbound) model of a resolved config (`model_args`) or of ModelArgs."""
  return MTPModel(config if isinstance(config, ModelArgs) else model_args(config))


def init_params(model: MTPModel, rng: jax.Array, seq_len: int = 8) -> Any:
  """Plain parameter pytree (logical-partitioning boxes removed)."""
  tokens = jnp.zeros((1, seq_len), jnp.int32)
  return jax.jit(lambda r: nn.unbox(model.init(r, tokens)["params"]))(rng)


def unembedding(params, args: ModelArgs) -> jax.Array:
  """The shared output matrix W_DxV (the transposed embedding when tied), V = args.padded_vocab
  columns: mask the logits of the pad ones (`mask_pad_logits`)."""
  return params["embed"]["embedding"].T if args.tie_embeddings else params["unembed"]


def mask_pad_logits(logits_xV: jax.Array, vocab_size: int) -> jax.Array:
  """-inf at the pad ids (>= vocab_size): they never win an argmax, get no probability and no
  share of a softmax, and their unembedding columns get no gradient. A no-op when unpadded."""
  if logits_xV.shape[-1] <= vocab_size:
    return logits_xV
  real_V = jnp.arange(logits_xV.shape[-1]) < vocab_size
  return jnp.where(real_V, logits_xV, -jnp.inf)


def logits(params, args: ModelArgs, h_NxBxSxD) -> jax.Array:
  """Logits of the given heads over the real ids (args.vocab_size wide, the pad columns cut
  off: a decoder or sampler cannot pick a pad id), f32: for decoding, sampling and tests; the
  loss never calls this."""
  logits_NxBxSxV = jnp.einsum("nbsd,dv->nbsv", h_NxBxSxD,
                              unembedding(params, args).astype(h_NxBxSxD.dtype),
                              preferred_element_type=jnp.float32)
  return logits_NxBxSxV[..., :args.vocab_size]


def unrolled(params, args: ModelArgs):
  """(params, args) of the same model with its trunk unrolled (scan_layers False): the stacked
  `trunk/layers` params split into `layers_0..n-1`, once. For decoding loops: inside a
  lax.while_loop, a scanned trunk copies every layer's weights out of the stacked arrays at
  every iteration (XLA:CPU does not hoist the slices out of the loop), an unrolled one reads
  them in place; then the head kind's own layout for decoding (`HeadKind.decode_layout`). The
  same maths (tests/test_model.py: scan == unrolled)."""
  if args.scan_layers and args.n_trunk:
    trunk = dict(params["trunk"])
    stacked = trunk.pop("layers")
    for i in range(args.n_trunk):
      trunk[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    params, args = {**params, "trunk": trunk}, dataclasses.replace(args, scan_layers=False)
  return heads.KINDS[args.head_kind].decode_layout(params, args)  # the heads' own (HeadKind)


def init_decode_cache(args: ModelArgs, batch: int, length: int, dtype=jnp.float32):
  """Zeroed KV caches for the trunk and every attention block of the heads. Leaves are
  [blocks, B, K, L, E] (heads-major: layers.init_cache)."""
  # An unrolled trunk gets one cache per layer ([1, B, K, L, E] leaves, a list): each layer's
  # keys are written in place, not sliced out of a stack and written back.
  trunk = (init_cache(args, args.n_trunk, batch, length, dtype) if args.scan_layers else
           [init_cache(args, 1, batch, length, dtype) for _ in range(args.n_trunk)])
  return {"trunk": trunk,
          "heads": heads.KINDS[args.head_kind].decode_cache(args, batch, length, dtype)}


def param_count(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
