"""Imports into a workdir (what `python -m mtp_jax.generate --workdir` reads: config.json and
a params-only orbax checkpoint at step 0) and the export of a workdir's trunk + head 1 as a
Hugging Face Llama.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util

from mtp_jax import config as config_lib
from mtp_jax import heads as heads_lib
from mtp_jax.config import validation
from mtp_jax import workdir as workdir_lib
from mtp_jax.checkpoint import Checkpointer
from mtp_jax.convert import families
from mtp_jax.convert.layouts import (check_tensors, deepseek_entries, llama_entries, meta_entries,
                                     param_shapes, read_params, to_torch, unpad)
from mtp_jax.convert.readers import MetaShards, Safetensors, read_json
from mtp_jax.data import hf_tokenizer, tokenizers

# Tensor names of blocks mtp_jax does not have: a DeepSeek checkpoint holding them is refused.
_MOE = ("mlp.experts.", "mlp.gate.weight", "shared_experts", "e_score_correction_bias")
_MLA = ("q_a_proj", "q_b_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm",
        "kv_b_proj")


def _tokenizer_fields(config: ml_collections.ConfigDict, path: str) -> None:
  """data.tokenizer and its file from a tokenizer path: a SentencePiece .model, or a
  tokenizer.json (or a folder holding one)."""
  d = config.data
  if os.path.isfile(path) and not path.endswith(".json"):
    d.tokenizer, d.spm_path = "sentencepiece", os.path.abspath(path)
  elif os.path.isfile(path) or os.path.isfile(os.path.join(path, "tokenizer.json")):
    d.tokenizer, d.hf_tokenizer = "hf", os.path.abspath(path)
  else:
    raise ValueError(f"--tokenizer: no SentencePiece model or tokenizer.json at {path!r}")


def check_coverage(tok, name: str) -> str:
  """A warning ("" if none) for a tokenizer that cannot encode printable ASCII (code): a
  SentencePiece model without byte_fallback, a tokenizer.json with an unknown token."""
  missing = []
  for ch in string.printable:
    try:
      tok.encode(ch)
    except ValueError:
      missing.append(ch)
  if not missing:
    return ""
  return (f"warning: --tokenizer: {name} cannot encode {len(missing)} printable ASCII "
          f"characters ({''.join(missing[:12])!r}...; no byte fallback): training on a text "
          "holding one stops with 'cannot encode text in FILE'; a tokenizer with byte_fallback "
          "covers every text")


def prepare_config(config: ml_collections.ConfigDict, path: str, source: str):
  """Validates `config` with the tokenizer at `path` (a SentencePiece .model, a tokenizer.json
  or its folder; "" = none: the byte tokenizer)."""
  m = config.model
  config.data.seq_len = min(config.data.seq_len, m.max_len)
  if path:
    _tokenizer_fields(config, path)
  try:
    validation.resolve(config)
  except ValueError as e:
    raise ValueError(f"--ckpt: the config converted from {source} is not valid: {e}") from None
  try:
    tok = tokenizers.get_tokenizer(config.data)
  except ValueError as e:
    raise ValueError(f"--tokenizer: {str(e).split(': ', 1)[-1]}") from None
  if tok.vocab_size > m.vocab_size:
    raise ValueError(f"--tokenizer: {path or 'the byte tokenizer'} has {tok.vocab_size} ids, "
                     f"more than the model's vocabulary ({m.vocab_size})"
                     + ("" if path else f"; {source} has no tokenizer.model or "
                        "tokenizer.json, name one"))
  warning = check_coverage(tok, path) if path else ""
  if warning:
    print(warning, file=sys.stderr)
  if not path:
    print(f"warning: {source} has no tokenizer.model or tokenizer.json and --tokenizer is not "
          "given: the workdir uses the byte tokenizer", file=sys.stderr)


def check_out(out: str) -> None:
  if os.path.exists(workdir_lib.checkpoints_dir(out)):
    raise ValueError(f"--out: {out!r} already holds {workdir_lib.CHECKPOINTS}/; convert into a "
                     "new folder")


def write_workdir(out: str, config: ml_collections.ConfigDict, params) -> None:
  """config.json (as a training run writes it), the tokenizer copied in (named relative to the
  workdir, so the workdir can move), a params-only checkpoint."""
  check_out(out)
  os.makedirs(out, exist_ok=True)
  d = config.data
  if d.tokenizer == "sentencepiece":
    dst = os.path.abspath(os.path.join(out, workdir_lib.SPM_MODEL))
    if os.path.abspath(d.spm_path) != dst:
      shutil.copyfile(d.spm_path, dst)
    d.spm_path = workdir_lib.SPM_MODEL
  if d.tokenizer == "hf":
    hf_tokenizer.copy_files(tokenizers.get_tokenizer(d), out)
    d.hf_tokenizer = hf_tokenizer.TOKENIZER_JSON
  workdir_lib.write_config(config, out)
  d.spm_path = os.path.join(os.path.abspath(out), d.spm_path) if d.spm_path else ""
  d.hf_tokenizer = os.path.join(os.path.abspath(out), d.hf_tokenizer) if d.hf_tokenizer else ""
  with Checkpointer(workdir_lib.checkpoints_dir(out), keep=1, async_save=False) as ckpt:
    ckpt.save(0, {"params": params})
    ckpt.wait()


def tokenizer_path(ckpt: str, given: str, *, parent: bool = True) -> str:
  """--tokenizer, else tokenizer.model in the checkpoint folder or (`parent`) its parent (Meta's
  release keeps one beside its 7B_*/ folders), else its tokenizer.json, else "" (none)."""
  if given:
    return given
  for folder in (ckpt, os.path.dirname(os.path.abspath(ckpt)))[:2 if parent else 1]:
    if os.path.isfile(os.path.join(folder, "tokenizer.model")):
      return os.path.join(folder, "tokenizer.model")
  if os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
    return os.path.join(ckpt, "tokenizer.json")
  return ""


def import_meta(ckpt: str, out: str, *, tokenizer: str = "", max_len: int = 0,
                dtype: str = "float32") -> ml_collections.ConfigDict:
  """facebook/multi-token-prediction (params.json, consolidated.NN.pth, 7B_*/ in the release)
  -> workdir `out`."""
  check_out(out)
  p = read_json(os.path.join(ckpt, "params.json"), "params.json")
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
  set_layout_heads(m, "meta")
  prepare_config(c, tokenizer_path(ckpt, tokenizer), ckpt)
  args, shapes = param_shapes(c)
  entries = meta_entries(args)
  check_tensors(source, entries, shapes, ckpt, "Meta", optional=("rope.freqs",))
  write_workdir(out, c, read_params(source, entries, shapes, jnp.dtype(dtype)))
  return c


def set_layout_heads(m: ml_collections.ConfigDict, layout: str) -> None:
  """config.model `m` gets the head kind (and its fields) of a released layout's heads."""
  kind = heads_lib.layout_kind(layout)
  m.heads.kind = kind.kind
  for field, value in kind.checkpoint_layouts[layout].items():
    m.heads[field] = value


def import_deepseek(ckpt: str, out: str, *, tokenizer: str = "", max_len: int = 0,
                    dtype: str = "float32") -> ml_collections.ConfigDict:
  """Dense Llama + DeepSeek-V3 MTP layers in HF safetensors layout -> workdir `out`."""
  check_out(out)
  hf = read_json(os.path.join(ckpt, "config.json"), "config.json")
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
  c = config_lib.base_config()
  families.model_fields(hf, c.model, "llama")
  m = c.model
  m.n_future = 1 + int(hf.get("num_nextn_predict_layers") or 0)
  m.max_len = max_len or int(hf.get("max_position_embeddings", 4096))
  set_layout_heads(m, "deepseek")
  prepare_config(c, tokenizer_path(ckpt, tokenizer), ckpt)
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
  """Trunk + head 1 of a workdir as HF files of its model.family (LlamaForCausalLM,
  Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM): config.json, model.safetensors
  (float32) and the tokenizer's file(s). numpy only."""
  loaded = workdir_lib.load_workdir(workdir)
  a, tok = loaded.model.args, loaded.tokenizer
  flat = traverse_util.flatten_dict(jax.device_get(loaded.params))
  loaded.params = None
  tensors = {}
  for e in llama_entries(a):
    x = flat[e.dst] if e.index is None else flat[e.dst][e.index]
    tensors[e.src] = to_torch(np.asarray(unpad(x, e), np.float32), e)  # the real vocab_size
  del flat
  hf = {
      "hidden_size": a.d_model, "intermediate_size": a.d_ff,
      "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
      "head_dim": a.head_dim,
      # The trunk, then head 1's own block if the kind gives it one (as llama_entries reads).
      "num_hidden_layers": a.n_trunk + len(heads_lib.KINDS[a.head_kind].head_params(1)),
      "rms_norm_eps": a.norm_eps, "vocab_size": a.vocab_size,
      "max_position_embeddings": a.max_len, "tie_word_embeddings": a.tie_embeddings,
      "hidden_act": "silu", "torch_dtype": "float32", **families.export_config(a, a.family),
  }
  return write_hf_folder(out, hf, tensors, tok, a.vocab_size)


def write_hf_folder(out: str, hf: dict, tensors: dict, tok, vocab_size: int) -> dict:
  """A Hugging Face style folder: config.json (`hf` with the tokenizer's bos/eos/pad ids),
  model.safetensors (`tensors`) and the tokenizer's file(s); returns the config written."""
  from safetensors.numpy import save_file
  for name in ("bos", "eos", "pad"):  # a test-sized vocabulary may not reach the byte ids
    i = getattr(tok, f"{name}_id")
    hf[f"{name}_token_id"] = i if 0 <= i < vocab_size else None
  if isinstance(tok, tokenizers.HFTokenizer) and not tok.has_bos:
    hf["bos_token_id"] = None
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "model.safetensors")
  save_file(tensors, path, metadata={"format": "pt"})
  os.chmod(path, 0o644)  # safetensors writes it owner-only
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  if isinstance(tok, tokenizers.SentencePieceTokenizer):
    shutil.copyfile(tok.path, os.path.join(out, "tokenizer.model"))
  if isinstance(tok, tokenizers.HFTokenizer):
    hf_tokenizer.copy_files(tok, out)
  return hf
