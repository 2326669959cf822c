"""Checkpoint interop: import Meta's multi-token-prediction weights and DeepSeek-V3-style MTP
layers on a dense Llama, export trunk + head 1 (the next-token model) as a Hugging Face Llama.

  python -m mtp_jax.convert meta --ckpt DIR --out WORKDIR [--tokenizer PATH]
  python -m mtp_jax.convert deepseek --ckpt DIR --out WORKDIR [--tokenizer PATH]
  python -m mtp_jax.convert to-hf --workdir WORKDIR --out DIR

An imported WORKDIR is what `python -m mtp_jax.generate --workdir WORKDIR` reads: config.json and
a params-only orbax checkpoint at step 0. Each layout is a table of `Entry` rows (foreign tensor
-> our parameter and its slot on a stacked axis), so a missing, unexpected or misshapen tensor is
one error naming it, raised before anything is written. Tensors are read one at a time from
memory-mapped files into preallocated stacked arrays: peak memory is about the converted model.

Torch and HF Linear weights are [out, in]; our kernels are [in..., out...], so kernel = W.T
reshaped. Meta's RoPE rotates interleaved pairs (x_2i, x_2i+1) (complex multiply); ours and HF's
rotate halves (x_i, x_i+E/2), so Meta's wq/wk rows are permuted within each head, row 2i + p ->
p * E/2 + i (as HF's convert_llama_weights_to_hf): q.k, hence attention, is unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import pickle
import shutil
import sys
from typing import Iterable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import traverse_util

from mtp_jax import config as config_lib
from mtp_jax.checkpoint import Checkpointer, checkpoint_dir
from mtp_jax.data import tokenizers
from mtp_jax.config import ModelArgs
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
# Meta's model-parallel shards (llama/model.py): column-parallel weights split their rows,
# row-parallel ones and the embedding their columns; norms are replicated.
_META_SPLIT = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0,
               "wo": 1, "w2": 1, "tok_embeddings": 1}
_MOE = ("mlp.experts.", "mlp.gate.weight", "shared_experts", "e_score_correction_bias")
_MLA = ("q_a_proj", "q_b_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm",
        "kv_b_proj")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One foreign tensor and where it goes."""
  src: str  # its name in the foreign checkpoint
  dst: tuple[str, ...]  # our parameter's path
  index: int | None = None  # slot on the parameter's stacked (layers / heads) axis
  n_in: int = 0  # leading axes of our kernel that are torch's input; 0: copied as is
  rope_heads: int = 0  # Meta wq/wk: heads whose rows go from interleaved to rotate-half


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
  out = [Entry("tok_embeddings.weight", ("embed", "embedding")), Entry("norm.weight", ("norm",)),
         Entry("output.weight", ("unembed",), n_in=1)]
  for i in range(a.n_trunk):
    out += block_entries(f"layers.{i}.", ("trunk", "layers"), i, a, meta=True)
  out += block_entries(f"layers.{a.n_trunk}.", ("heads", "blocks"), 0, a, meta=True)
  for j in range(a.n_future - 1):
    out += block_entries(f"extra_heads.{j}.", ("heads", "blocks"), j + 1, a, meta=True)
  return out


def llama_entries(a: ModelArgs) -> list[Entry]:
  """HF LlamaForCausalLM of trunk + head 1: parallel heads add head 1's block; projection and
  sequential heads' head 1 is the trunk itself."""
  out = [Entry("model.embed_tokens.weight", ("embed", "embedding")),
         Entry("model.norm.weight", ("norm",))]
  if not a.tie_embeddings:
    out.append(Entry("lm_head.weight", ("unembed",), n_in=1))
  for i in range(a.n_trunk):
    dst, index = (("trunk", "layers"), i) if a.scan_layers else (("trunk", f"layers_{i}"), None)
    out += block_entries(f"model.layers.{i}.", dst, index, a, meta=False)
  if a.head_kind == "parallel":
    out += block_entries(f"model.layers.{a.n_trunk}.", ("heads", "blocks"), 0, a, meta=False)
  return out


def deepseek_entries(a: ModelArgs) -> list[Entry]:
  """Main model as HF Llama, MTP module k at model.layers.{n_layers + k}."""
  out = llama_entries(a)
  depths = ("heads", "depths")
  for k in range(a.n_future - 1):
    p = f"model.layers.{a.n_trunk + k}."
    out += block_entries(p, depths + ("block",), k, a, meta=False)
    out += [Entry(p + "enorm.weight", depths + ("enorm", "scale"), k),
            Entry(p + "hnorm.weight", depths + ("hnorm", "scale"), k),
            Entry(p + "eh_proj.weight", depths + ("eh_proj", "kernel"), k, n_in=1),
            Entry(p + "shared_head.norm.weight", depths + ("shared_head_norm", "scale"), k)]
  return out


# Reading foreign checkpoints.


class MetaShards:
  """The *.pth files of a folder in sorted order (consolidated.NN.pth, as Meta's llama loads
  them), memory-mapped; a tensor's model-parallel shards are joined only when it is read."""

  def __init__(self, ckpt: str):
    import torch  # pylint: disable=import-outside-toplevel
    paths = sorted(glob.glob(os.path.join(ckpt, "*.pth")))
    if not paths:
      raise ValueError(f"--ckpt: no *.pth (consolidated.00.pth) in {ckpt!r}")
    self.shards = []
    for path in paths:
      try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
      except pickle.UnpicklingError:
        raise ValueError(f"--ckpt: {path} needs pickled code to load (torch.load with "
                         "weights_only=True refused it); only plain tensor files are read"
                         ) from None
      except RuntimeError as e:
        raise ValueError(f"--ckpt: {path} does not load as a memory-mapped torch file: "
                         f"{str(e).splitlines()[0]}") from None
      if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"--ckpt: {path} is not a dict of tensors")
      if self.shards and set(sd) != set(self.shards[0]):
        odd = sorted(set(sd) ^ set(self.shards[0]))[0]
        raise ValueError(f"--ckpt: {path} and {paths[0]} disagree on tensor {odd!r}")
      self.shards.append(sd)

  def keys(self) -> Iterable[str]:
    return self.shards[0].keys()

  def _dim(self, key: str) -> int | None:
    return _META_SPLIT.get(key.rsplit(".", 2)[-2]) if len(self.shards) > 1 else None

  def shape(self, key: str) -> tuple[int, ...]:
    dim, shape = self._dim(key), list(self.shards[0][key].shape)
    if dim is not None and len(shape) > dim:
      shape[dim] = sum(sd[key].shape[dim] for sd in self.shards)
    return tuple(shape)

  def get(self, key: str) -> np.ndarray:
    dim = self._dim(key)
    if dim is None:
      return self.shards[0][key].float().numpy()
    return np.concatenate([sd[key].float().numpy() for sd in self.shards], axis=dim)


class Safetensors:
  """The files model.safetensors.index.json names, else every *.safetensors; memory-mapped."""

  def __init__(self, ckpt: str):
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.isfile(index):
      names = set(_read_json(index, "index")["weight_map"].values())
      files = sorted(os.path.join(ckpt, name) for name in names)
    else:
      files = sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))
    if not files:
      raise ValueError(f"--ckpt: no *.safetensors in {ckpt!r}")
    self._where = {}
    for path in files:
      f = safe_open(path, framework="numpy")
      for key in f.keys():
        self._where[key] = f

  def keys(self) -> Iterable[str]:
    return self._where.keys()

  def shape(self, key: str) -> tuple[int, ...]:
    return tuple(self._where[key].get_slice(key).get_shape())

  def get(self, key: str) -> np.ndarray:
    return np.asarray(self._where[key].get_tensor(key), np.float32)


def check_tensors(source, entries: list[Entry], shapes: dict, ckpt: str, layout: str,
                  optional=()) -> None:
  """Every tensor the layout names is there with its shape, and nothing else is."""
  want = {e.src: e for e in entries}
  have = set(source.keys())
  for e in entries:
    s = shapes[e.dst].shape[0 if e.index is None else 1:]
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
  """Our params tree, filled tensor by tensor (checked with `check_tensors` first)."""
  out = {path: np.empty(s.shape, dtype) for path, s in shapes.items()}
  filled = {path: 0 for path in shapes}
  for e in entries:
    x = to_ours(source.get(e.src), e, out[e.dst].shape[0 if e.index is None else 1:])
    if e.index is None:
      out[e.dst][...] = x
    else:
      out[e.dst][e.index] = x
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


# Writing workdirs.


def prepare_config(config: ml_collections.ConfigDict, spm: str, source: str):
  """Validates `config` with the tokenizer at `spm` ("" = none: the byte tokenizer)."""
  m = config.model
  config.data.seq_len = min(config.data.seq_len, m.max_len)
  if spm:
    if not os.path.isfile(spm):
      raise ValueError(f"--tokenizer: no SentencePiece model at {spm!r}")
    config.data.tokenizer, config.data.spm_path = "sentencepiece", os.path.abspath(spm)
  try:
    config_lib.validate(config)
  except ValueError as e:
    raise ValueError(f"--ckpt: the config converted from {source} is not valid: {e}") from None
  tok = tokenizers.get_tokenizer(config.data)
  if tok.vocab_size > m.vocab_size:
    raise ValueError(f"--tokenizer: {spm or 'the byte tokenizer'} has {tok.vocab_size} ids, more "
                     f"than the model's vocabulary ({m.vocab_size})"
                     + ("" if spm else f"; {source} has no tokenizer.model, name one"))
  if not spm:
    print(f"warning: {source} has no tokenizer.model and --tokenizer is not given: the workdir "
          "uses the byte tokenizer", file=sys.stderr)


def check_out(out: str) -> None:
  if os.path.exists(os.path.join(out, "checkpoints")):
    raise ValueError(f"--out: {out!r} already holds checkpoints/; convert into a new folder")


def write_workdir(out: str, config: ml_collections.ConfigDict, params) -> None:
  """config.json (as a training run writes it), the tokenizer copied in, a params-only
  checkpoint."""
  check_out(out)
  os.makedirs(out, exist_ok=True)
  if config.data.tokenizer == "sentencepiece":
    dst = os.path.abspath(os.path.join(out, "tokenizer.model"))
    if os.path.abspath(config.data.spm_path) != dst:
      shutil.copyfile(config.data.spm_path, dst)
    config.data.spm_path = dst
  config_lib.save_json(config, os.path.join(out, "config.json"))
  with Checkpointer(checkpoint_dir(out), keep=1, async_save=False) as ckpt:
    ckpt.save(0, {"params": params})
    ckpt.wait()


def _read_json(path: str, what: str) -> dict:
  if not os.path.isfile(path):
    raise ValueError(f"--ckpt: no {what} at {path!r}")
  with open(path) as f:
    return json.load(f)


def _tokenizer_path(ckpt: str, given: str) -> str:
  """--tokenizer, else tokenizer.model in the checkpoint folder or its parent (Meta's release
  keeps one beside its 7B_*/ folders), else "" (none)."""
  if given:
    return given
  for folder in (ckpt, os.path.dirname(os.path.abspath(ckpt))):
    if os.path.isfile(os.path.join(folder, "tokenizer.model")):
      return os.path.join(folder, "tokenizer.model")
  return ""


def import_meta(ckpt: str, out: str, *, tokenizer: str = "", max_len: int = 0,
                dtype: str = "float32") -> ml_collections.ConfigDict:
  """facebook/multi-token-prediction (params.json, consolidated.NN.pth, 7B_*/ in the release)
  -> workdir `out`."""
  check_out(out)
  p = _read_json(os.path.join(ckpt, "params.json"), "params.json")
  source = MetaShards(ckpt)
  if "tok_embeddings.weight" not in source.keys():
    raise ValueError(f"--ckpt: {ckpt} has no tensor 'tok_embeddings.weight'")
  c = config_lib.base_config()
  m = c.model
  try:
    dim = int(p["dim"])
    m.d_model, m.n_layers, m.n_heads = dim, int(p["n_layers"]), int(p["n_heads"])
  except KeyError as e:
    raise ValueError(f"--ckpt: params.json has no {e.args[0]!r}") from None
  m.n_kv_heads = int(p.get("n_kv_heads") or m.n_heads)
  hidden = int(2 * 4 * dim / 3)  # Meta's llama FeedForward
  if p.get("ffn_dim_multiplier") is not None:
    hidden = int(p["ffn_dim_multiplier"] * hidden)
  multiple = int(p.get("multiple_of", 256))
  m.d_ff = multiple * -(-hidden // multiple)
  vocab = int(p.get("vocab_size", -1))
  m.vocab_size = vocab if vocab > 0 else source.shape("tok_embeddings.weight")[0]
  m.norm_eps = float(p.get("norm_eps", 1e-5))
  m.rope_theta = float(p.get("rope_theta") or 10000.0)
  m.n_future = int(p.get("n_future_tokens", 1))
  m.max_len = max_len or int(p.get("max_seq_len", 4096))
  m.tie_embeddings = False
  m.heads.kind = "parallel"
  prepare_config(c, _tokenizer_path(ckpt, tokenizer), ckpt)
  args, shapes = param_shapes(c)
  entries = meta_entries(args)
  check_tensors(source, entries, shapes, ckpt, "Meta", optional=("rope.freqs",))
  write_workdir(out, c, read_params(source, entries, shapes, jnp.dtype(dtype)))
  return c


def import_deepseek(ckpt: str, out: str, *, tokenizer: str = "", max_len: int = 0,
                    dtype: str = "float32") -> ml_collections.ConfigDict:
  """Dense Llama + DeepSeek-V3 MTP layers in HF safetensors layout -> workdir `out`."""
  check_out(out)
  hf = _read_json(os.path.join(ckpt, "config.json"), "config.json")
  dense_only = "mtp_jax handles dense Llama-style attention and MLP only"
  if hf.get("n_routed_experts") or hf.get("num_experts") or hf.get("num_local_experts"):
    raise ValueError(f"--ckpt: config.json describes Mixture-of-Experts blocks; {dense_only}")
  if hf.get("q_lora_rank") or hf.get("kv_lora_rank"):
    raise ValueError(f"--ckpt: config.json describes MLA attention (q/kv_lora_rank); {dense_only}")
  source = Safetensors(ckpt)
  for key in source.keys():
    for patterns, what in ((_MOE, "a Mixture-of-Experts"), (_MLA, "an MLA attention")):
      if any(s in key for s in patterns):
        raise ValueError(f"--ckpt: tensor {key!r} belongs to {what} block; {dense_only}")
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers 5 / 4
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    raise ValueError(f"--ckpt: config.json asks for {rope.get('rope_type', rope.get('type'))!r} "
                     "RoPE scaling, which mtp_jax's RoPE does not have")
  if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
    raise ValueError(f"--ckpt: config.json asks for biases or a non-SiLU MLP; {dense_only}")
  c = config_lib.base_config()
  m = c.model
  try:
    m.d_model, m.n_layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    m.n_heads, m.d_ff = int(hf["num_attention_heads"]), int(hf["intermediate_size"])
    m.vocab_size = int(hf["vocab_size"])
  except KeyError as e:
    raise ValueError(f"--ckpt: config.json has no {e.args[0]!r}") from None
  if hf.get("head_dim") not in (None, m.d_model // m.n_heads):
    raise ValueError(f"--ckpt: config.json head_dim {hf['head_dim']} != hidden_size / "
                     "num_attention_heads, which mtp_jax's attention assumes")
  m.n_kv_heads = int(hf.get("num_key_value_heads") or m.n_heads)
  m.norm_eps = float(hf.get("rms_norm_eps", 1e-6))
  m.rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
  m.tie_embeddings = bool(hf.get("tie_word_embeddings", False))
  m.n_future = 1 + int(hf.get("num_nextn_predict_layers") or 0)
  m.max_len = max_len or int(hf.get("max_position_embeddings", 4096))
  m.heads.kind, m.heads.seq_preset = "sequential", "deepseek_v3"
  prepare_config(c, _tokenizer_path(ckpt, tokenizer), ckpt)
  args, shapes = param_shapes(c)
  entries = deepseek_entries(args)
  # Each MTP module stores copies of the shared embedding and output matrix.
  shared = {}
  for k in range(args.n_future - 1):
    p = f"model.layers.{args.n_trunk + k}."
    shared[p + "embed_tokens.weight"] = "model.embed_tokens.weight"
    shared[p + "shared_head.head.weight"] = ("model.embed_tokens.weight" if args.tie_embeddings
                                             else "lm_head.weight")
  ignored = {k for k in source.keys() if k.endswith("rotary_emb.inv_freq")}
  check_tensors(source, entries, shapes, ckpt, "DeepSeek MTP", optional=set(shared) | ignored)
  for key, main in shared.items():
    if key in source.keys() and not np.array_equal(source.get(key), source.get(main)):
      print(f"warning: {key} differs from {main}; mtp_jax shares one matrix and keeps {main}",
            file=sys.stderr)
  write_workdir(out, c, read_params(source, entries, shapes, jnp.dtype(dtype)))
  return c


def export_hf(workdir: str, out: str) -> dict:
  """Trunk + head 1 of a workdir as HF LlamaForCausalLM files: config.json, model.safetensors
  (float32) and tokenizer.model when the workdir has a SentencePiece model. numpy only."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  from mtp_jax import generate  # pylint: disable=import-outside-toplevel
  loaded = generate.load_workdir(workdir)
  a, tok = loaded.model.args, loaded.tokenizer
  flat = traverse_util.flatten_dict(jax.device_get(loaded.params))
  loaded.params = None
  tensors = {}
  for e in llama_entries(a):
    x = flat[e.dst] if e.index is None else flat[e.dst][e.index]
    tensors[e.src] = to_torch(np.asarray(x, np.float32), e)
  del flat
  hf = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "hidden_size": a.d_model, "intermediate_size": a.d_ff,
      "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
      "head_dim": a.head_dim,
      "num_hidden_layers": a.n_trunk + (a.head_kind == "parallel"),
      "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta, "rope_scaling": None,
      "vocab_size": a.vocab_size, "max_position_embeddings": a.max_len,
      "tie_word_embeddings": a.tie_embeddings, "hidden_act": "silu",
      "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
  }
  for name in ("bos", "eos", "pad"):  # a test-sized vocabulary may not reach the byte ids
    i = getattr(tok, f"{name}_id")
    hf[f"{name}_token_id"] = i if 0 <= i < a.vocab_size else None
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "model.safetensors")
  save_file(tensors, path, metadata={"format": "pt"})
  os.chmod(path, 0o644)  # safetensors writes it owner-only
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  if isinstance(tok, tokenizers.SentencePieceTokenizer):
    shutil.copyfile(tok.path, os.path.join(out, "tokenizer.model"))
  return hf


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m mtp_jax.convert",
                                   description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  for name, what in (("meta", "facebook/multi-token-prediction (params.json, *.pth)"),
                     ("deepseek", "dense Llama + DeepSeek-V3 MTP layers, HF safetensors")):
    p = sub.add_parser(name, help=f"import {what} into a workdir")
    p.add_argument("--ckpt", required=True, help="checkpoint folder")
    p.add_argument("--out", required=True, help="workdir to write")
    p.add_argument("--tokenizer", default="",
                   help="SentencePiece model (default: tokenizer.model in --ckpt)")
    p.add_argument("--max_len", type=int, default=0,
                   help="longest sequence for generate (default: from the checkpoint's config)")
    p.add_argument("--dtype", default="float32", choices=config_lib.DTYPES,
                   help="stored parameter dtype (restored as float32)")
  p = sub.add_parser("to-hf", help="export trunk + head 1 as a HF LlamaForCausalLM")
  p.add_argument("--workdir", required=True)
  p.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  try:
    if args.command == "to-hf":
      hf = export_hf(args.workdir, args.out)
      print(f"wrote {args.out}: LlamaForCausalLM, {hf['num_hidden_layers']} layers")
      return 0
    fn = import_meta if args.command == "meta" else import_deepseek
    c = fn(args.ckpt, args.out, tokenizer=args.tokenizer, max_len=args.max_len,
           dtype=args.dtype)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.out}: {c.model.heads.kind} heads, n_future {c.model.n_future}, "
        f"{c.model.n_layers} layers; try python -m mtp_jax.generate --workdir {args.out} "
        "--mode both --prompt ...")
  return 0


if __name__ == "__main__":
  sys.exit(main())
