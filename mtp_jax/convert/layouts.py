"""Layouts: where each tensor of a foreign checkpoint goes in our params (Meta's
multi-token-prediction release, Hugging Face Llama, DeepSeek-V3's MTP modules on a dense Llama).

Each layout is a table of `Entry` rows (foreign tensor -> our parameter and its slot on a stacked
axis), so a missing, unexpected or misshapen tensor is one error naming it (`check_tensors`),
raised before anything is written, and `read_params` fills preallocated stacked arrays one tensor
at a time: peak memory is about the converted model.

Torch and HF Linear weights are [out, in]; our kernels are [in..., out...], so kernel = W.T
reshaped. Meta's RoPE rotates interleaved pairs (x_2i, x_2i+1) (complex multiply); ours and HF's
rotate halves (x_i, x_i+E/2), so Meta's wq/wk rows are permuted within each head, row 2i + p ->
p * E/2 + i (as HF's convert_llama_weights_to_hf): q.k, hence attention, is unchanged.

Our embedding and unembedding are padded to `ModelArgs.padded_vocab` (model.vocab_multiple);
foreign checkpoints hold the real vocab_size: imported tensors fill the first rows (pad rows are
zero, and masked anyway), exports keep the real rows (`Entry.vocab_axis`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import ml_collections
import numpy as np
from flax import traverse_util

from mtp_jax import heads as heads_lib
from mtp_jax.model_args import ModelArgs
from mtp_jax.model import build_model, init_params

# (our path inside a Block, Meta name, HF Llama name, leading input axes of our kernel; 0: a
# norm scale, copied as is).
BLOCK = (
    (("attention", "wq", "kernel"), "attention.wq", "self_attn.q_proj", 1),
    (("attention", "wk", "kernel"), "attention.wk", "self_attn.k_proj", 1),
    (("attention", "wv", "kernel"), "attention.wv", "self_attn.v_proj", 1),
    (("attention", "wo", "kernel"), "attention.wo", "self_attn.o_proj", 2),
    (("feed_forward", "w1", "kernel"), "feed_forward.w1", "mlp.gate_proj", 1),
    (("feed_forward", "w3", "kernel"), "feed_forward.w3", "mlp.up_proj", 1),
    (("feed_forward", "w2", "kernel"), "feed_forward.w2", "mlp.down_proj", 1),
    (("attention_norm", "scale"), "attention_norm", "input_layernorm", 0),
    (("ffn_norm", "scale"), "ffn_norm", "post_attention_layernorm", 0),
)
@dataclasses.dataclass(frozen=True)
class Entry:
  """One foreign tensor and where it goes."""
  src: str  # its name in the foreign checkpoint
  dst: tuple[str, ...]  # our parameter's path
  index: int | None = None  # slot on the parameter's stacked (layers / heads) axis
  n_in: int = 0  # leading axes of our kernel that are torch's input; 0: copied as is
  rope_heads: int = 0  # Meta wq/wk: heads whose rows go from interleaved to rotate-half
  vocab_axis: int | None = None  # our axis that is the (padded) vocabulary ...
  vocab: int = 0  # ... and its real size, the foreign tensor's


def real_shape(e: Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
  """Our (per-slot) shape with the vocabulary axis at its real size: the foreign tensor's."""
  if e.vocab_axis is None:
    return tuple(shape)
  return tuple(e.vocab if i == e.vocab_axis else n for i, n in enumerate(shape))


def unpad(x: np.ndarray, e: Entry) -> np.ndarray:
  """Our parameter with the pad rows of its vocabulary axis dropped (for an export)."""
  if e.vocab_axis is None:
    return x
  return x[(slice(None),) * e.vocab_axis + (slice(0, e.vocab),)]


def vocab_entries(a: ModelArgs, embed: str, unembed: str | None) -> list[Entry]:
  """The embedding (rows: vocabulary) and, if named, the untied output matrix (ours [D, V])."""
  out = [Entry(embed, ("embed", "embedding"), vocab_axis=0, vocab=a.vocab_size)]
  if unembed:
    out.append(Entry(unembed, ("unembed",), n_in=1, vocab_axis=1, vocab=a.vocab_size))
  return out


def torch_shape(e: Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The foreign tensor's shape, given our (per-slot) shape."""
  if not e.n_in:
    return tuple(shape)
  return (math.prod(shape[e.n_in:]), math.prod(shape[:e.n_in]))


def to_ours(w: np.ndarray, e: Entry, shape: tuple[int, ...]) -> np.ndarray:
  if e.rope_heads:
    w = w.reshape(e.rope_heads, -1, 2, w.shape[-1]).transpose(0, 2, 1, 3).reshape(w.shape)
  return w.T.reshape(shape) if e.n_in else w


def to_torch(x: np.ndarray, e: Entry) -> np.ndarray:
  """Inverse of `to_ours` for rotate-half layouts (HF)."""
  if e.n_in:
    x = x.reshape(math.prod(x.shape[:e.n_in]), -1).T
  return np.ascontiguousarray(x)


def block_entries(prefix: str, dst: tuple[str, ...], index: int | None, a: ModelArgs, *,
                  meta: bool) -> list[Entry]:
  rope = {"wq": a.n_heads, "wk": a.n_kv_heads} if meta else {}
  return [Entry(f"{prefix}{m if meta else h}.weight", dst + ours, index, n_in,
                rope.get(ours[1], 0)) for ours, m, h, n_in in BLOCK]


def meta_entries(a: ModelArgs) -> list[Entry]:
  """facebook/multi-token-prediction: `layers` = trunk + head 1, `extra_heads` = heads 2..n."""
  out = vocab_entries(a, "tok_embeddings.weight", "output.weight") + [
      Entry("norm.weight", ("norm",))]
  for i in range(a.n_trunk):
    out += block_entries(f"layers.{i}.", ("trunk", "layers"), i, a, meta=True)
  heads = heads_lib.KINDS[a.head_kind]  # parallel, as the Meta importer sets it
  [(dst, index)] = heads.head_params(1)
  out += block_entries(f"layers.{a.n_trunk}.", dst, index, a, meta=True)
  for j in range(2, a.n_future + 1):
    [(dst, index)] = heads.head_params(j)
    out += block_entries(f"extra_heads.{j - 2}.", dst, index, a, meta=True)
  return out


def llama_entries(a: ModelArgs) -> list[Entry]:
  """HF LlamaForCausalLM of trunk + head 1: parallel heads add head 1's block; projection and
  sequential heads' head 1 is the trunk itself."""
  out = vocab_entries(a, "model.embed_tokens.weight",
                     None if a.tie_embeddings else "lm_head.weight") + [
      Entry("model.norm.weight", ("norm",))]
  for i in range(a.n_trunk):
    dst, index = (("trunk", "layers"), i) if a.scan_layers else (("trunk", f"layers_{i}"), None)
    out += block_entries(f"model.layers.{i}.", dst, index, a, meta=False)
  for dst, index in heads_lib.KINDS[a.head_kind].head_params(1):  # head 1's own block, if any
    out += block_entries(f"model.layers.{a.n_trunk}.", dst, index, a, meta=False)
  return out


def deepseek_entries(a: ModelArgs) -> list[Entry]:
  """Main model as HF Llama, MTP module k at model.layers.{n_layers + k}."""
  out = llama_entries(a)
  for k in range(a.n_future - 1):
    # MTP module k is head k + 2 (sequential depths, as the DeepSeek importer sets them).
    [(depths, i)] = heads_lib.KINDS[a.head_kind].head_params(k + 2)
    p = f"model.layers.{a.n_trunk + k}."
    out += block_entries(p, depths + ("block",), i, a, meta=False)
    out += [Entry(p + "enorm.weight", depths + ("enorm", "scale"), i),
            Entry(p + "hnorm.weight", depths + ("hnorm", "scale"), i),
            Entry(p + "eh_proj.weight", depths + ("eh_proj", "kernel"), i, n_in=1),
            Entry(p + "shared_head.norm.weight", depths + ("shared_head_norm", "scale"), i)]
  return out


def check_tensors(source, entries: list[Entry], shapes: dict, ckpt: str, layout: str,
                  optional=()) -> None:
  """Every tensor the layout names is there with its shape, and nothing else is."""
  want = {e.src: e for e in entries}
  have = set(source.keys())
  for e in entries:
    s = real_shape(e, shapes[e.dst].shape[0 if e.index is None else 1:])
    expected = torch_shape(e, s)
    if e.src not in have:
      raise ValueError(f"--ckpt: {ckpt} has no tensor {e.src!r} (expected shape {expected} for "
                       f"the {layout} layout of its config)")
    if source.shape(e.src) != expected:
      raise ValueError(f"--ckpt: tensor {e.src!r} has shape {source.shape(e.src)}, expected "
                       f"{expected} from the config")
  extra = sorted(k for k in have - set(want) if k not in optional)
  if extra:
    raise ValueError(f"--ckpt: unexpected tensor {extra[0]!r} (shape {source.shape(extra[0])}; "
                     f"{len(extra)} in all): not part of the {layout} layout of its config")


def read_params(source, entries: list[Entry], shapes: dict, dtype) -> dict:
  """Our params tree, filled tensor by tensor (checked with `check_tensors` first); the pad
  rows of a padded vocabulary are zero."""
  out = {path: np.empty(s.shape, dtype) for path, s in shapes.items()}
  filled = {path: 0 for path in shapes}
  for e in entries:
    slot = out[e.dst] if e.index is None else out[e.dst][e.index]  # a view
    x = to_ours(source.get(e.src), e, real_shape(e, slot.shape))
    if e.vocab_axis is not None:
      slot[...] = 0
    slot[tuple(slice(0, n) for n in x.shape)] = x
    filled[e.dst] += 1
  for path, n in filled.items():  # the tables above are wrong if this fails
    want = 1 if not any(e.dst == path and e.index is not None for e in entries) else len(out[path])
    if n != want:
      raise RuntimeError(f"convert: parameter {'/'.join(path)} filled {n} times, not {want}")
  return traverse_util.unflatten_dict(out)


def param_shapes(config: ml_collections.ConfigDict) -> tuple[ModelArgs, dict]:
  model = build_model(config)
  tree = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
  return model.args, traverse_util.flatten_dict(tree)
