"""Exports that keep the heads: a workdir's parallel heads in Meta's multi-token-prediction
layout (`to-meta`) and its sequential heads as DeepSeek-V3 MTP layers (`to-deepseek`); the
inverses of `workdir.import_meta` and `workdir.import_deepseek`, from the same layout tables
(layouts.meta_entries, layouts.deepseek_entries).

  python -m mtp_jax.convert to-meta --workdir RUN --out DIR      # params.json, consolidated.00.pth
  python -m mtp_jax.convert to-deepseek --workdir RUN --out DIR  # config.json, model.safetensors

Meta: `layers` = trunk + head 1, `extra_heads` = heads 2..n, params.json with n_future_tokens;
wq/wk rows go back from rotate-half to Meta's interleaved RoPE pairs. DeepSeek: the main model
as HF Llama names, MTP module k at model.layers.{n_trunk + k} with its own copies of the
embedding and output matrix (as DeepSeek-V3 ships them), num_nextn_predict_layers in
config.json. Tensors are float32 with the real vocabulary rows (the pad rows dropped).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
from flax import traverse_util

from mtp_jax import heads
from mtp_jax.convert.layouts import Entry, deepseek_entries, meta_entries, to_torch, unpad
from mtp_jax.data import tokenizers


def _load(workdir: str):
  from mtp_jax import workdir as workdir_lib
  if not os.path.isfile(os.path.join(workdir, "config.json")):
    raise ValueError(f"--workdir: {workdir!r} has no config.json")
  loaded = workdir_lib.load_workdir(workdir)
  a = loaded.model.args
  # Meta's and DeepSeek's layouts are a plain Llama: the model-family features have no place.
  for field, plain in (("qkv_bias", False), ("qk_norm", False), ("rope_scaling", "none"),
                       ("sliding_window", 0)):
    if getattr(a, field) != plain:
      raise ValueError(f"--workdir: {workdir!r} has model.{field} = {getattr(a, field)!r}, "
                       "which Meta's and DeepSeek's layouts cannot hold; to-hf writes its family")
  flat = traverse_util.flatten_dict(jax.device_get(loaded.params))
  loaded.params = None
  return loaded, flat


def _ours(flat: dict, e: Entry) -> np.ndarray:
  """Our tensor of an entry, an unrolled trunk (model.scan_layers False) included."""
  if e.dst in flat:
    x = flat[e.dst] if e.index is None else flat[e.dst][e.index]
  else:  # ("trunk", "layers", ...), i -> ("trunk", "layers_i", ...)
    x = flat[(e.dst[0], f"{e.dst[1]}_{e.index}") + e.dst[2:]]
  return np.asarray(unpad(np.asarray(x), e), np.float32)


def to_meta_rows(w: np.ndarray, e: Entry) -> np.ndarray:
  """Inverse of layouts.to_ours for a Meta tensor: [out, in], and wq/wk rows from rotate-half
  (p * E/2 + i) back to interleaved pairs (2i + p)."""
  w = to_torch(w, e)
  if e.rope_heads:
    w = w.reshape(e.rope_heads, 2, -1, w.shape[-1]).transpose(0, 2, 1, 3).reshape(w.shape)
  return np.ascontiguousarray(w)


def _copy_tokenizer(tok, out: str) -> None:
  if isinstance(tok, tokenizers.SentencePieceTokenizer):
    shutil.copyfile(tok.path, os.path.join(out, "tokenizer.model"))


def meta_ffn(dim: int, d_ff: int) -> dict:
  """multiple_of and ffn_dim_multiplier from which Meta's FeedForward (and import_meta) compute
  d_ff: Meta's own 256 when that gives it, else d_ff itself as the multiple."""
  hidden = int(2 * 4 * dim / 3)
  if 256 * -(-hidden // 256) == d_ff:
    return {"multiple_of": 256, "ffn_dim_multiplier": None}
  if hidden <= d_ff:
    return {"multiple_of": d_ff, "ffn_dim_multiplier": None}
  return {"multiple_of": d_ff, "ffn_dim_multiplier": d_ff / hidden}  # int(.) in (0, d_ff]


def export_meta(workdir: str, out: str) -> dict:
  """Parallel heads -> params.json + consolidated.00.pth (+ tokenizer.model); returns the
  params.json written."""
  import torch
  loaded, flat = _load(workdir)
  a = loaded.model.args
  meta, deepseek = heads.layout_kind("meta").kind, heads.layout_kind("deepseek").kind
  if a.head_kind != meta:
    raise ValueError(f"--workdir: {workdir!r} has {a.head_kind} heads; to-meta writes Meta's "
                     f"layout of {meta} heads (use to-deepseek for {deepseek} heads, to-hf for "
                     "the trunk + head 1 of any kind)")
  tensors = {}
  for e in meta_entries(a):
    if e.dst == ("unembed",) and a.tie_embeddings:
      continue  # Meta's layout always has an output matrix: the embedding (below)
    tensors[e.src] = torch.from_numpy(np.array(to_meta_rows(_ours(flat, e), e)))
  if a.tie_embeddings:
    tensors["output.weight"] = tensors["tok_embeddings.weight"].clone()
  params = {"dim": a.d_model, "n_layers": a.n_layers, "n_heads": a.n_heads,
            "n_kv_heads": a.n_kv_heads, "vocab_size": a.vocab_size, "norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta, "max_seq_len": a.max_len, "n_future_tokens": a.n_future,
            **meta_ffn(a.d_model, a.d_ff)}
  os.makedirs(out, exist_ok=True)
  torch.save(tensors, os.path.join(out, "consolidated.00.pth"))
  with open(os.path.join(out, "params.json"), "w") as f:
    json.dump(params, f, indent=2)
  _copy_tokenizer(loaded.tokenizer, out)
  return params


def export_deepseek(workdir: str, out: str) -> dict:
  """Sequential heads (DeepSeek-V3's preset) -> config.json + model.safetensors (+
  tokenizer.model); returns the config.json written."""
  from mtp_jax.convert.workdir import write_hf_folder
  loaded, flat = _load(workdir)
  a = loaded.model.args
  kind = heads.layout_kind("deepseek")
  layout = kind.layout_fields("deepseek")
  if a.head_kind != kind.kind or any(getattr(a, k) != v for k, v in layout.items()):
    got = a.head_kind if a.head_kind != kind.kind else f"{kind.kind} heads with " + ", ".join(
        f"{k} {getattr(a, k)!r}" for k in layout)
    needs = ", ".join(f"model.heads.{k} {v!r}"
                      for k, v in kind.checkpoint_layouts["deepseek"].items())
    raise ValueError(f"--workdir: {workdir!r} has {got}; to-deepseek writes DeepSeek-V3's MTP "
                     f"layers ({needs}: " + ", ".join(f"{k} {v!r}" for k, v in layout.items())
                     + f"); use to-meta for {heads.layout_kind('meta').kind} heads, to-hf for "
                     "the trunk + head 1 of any kind")
  tensors = {e.src: to_torch(_ours(flat, e), e) for e in deepseek_entries(a)}
  embed = tensors["model.embed_tokens.weight"]
  head = embed if a.tie_embeddings else tensors["lm_head.weight"]
  for k in range(a.n_future - 1):  # DeepSeek-V3 stores each MTP module's own copies
    p = f"model.layers.{a.n_trunk + k}."
    tensors[p + "embed_tokens.weight"] = embed.copy()
    tensors[p + "shared_head.head.weight"] = head.copy()
  tok = loaded.tokenizer
  config = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "hidden_size": a.d_model, "intermediate_size": a.d_ff,
      "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
      "head_dim": a.head_dim, "num_hidden_layers": a.n_trunk,
      "num_nextn_predict_layers": a.n_future - 1,
      "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta, "rope_scaling": None,
      "vocab_size": a.vocab_size, "max_position_embeddings": a.max_len,
      "tie_word_embeddings": a.tie_embeddings, "hidden_act": "silu",
      "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
  }
  return write_hf_folder(out, config, tensors, tok, a.vocab_size)
