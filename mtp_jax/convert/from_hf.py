"""Add multi-token-prediction heads to a pretrained next-token model: a Hugging Face
`LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` or `MistralForCausalLM` (safetensors;
convert/families.py) becomes a workdir whose head 1 is the HF model, exactly, and
whose heads 2..n are new, to be fine-tuned (`train.init_from`, `optim.trainable = "heads"`).

  python -m mtp_jax.convert from-hf --ckpt DIR --out WORKDIR --n_future 4 \\
      --heads parallel|projection|sequential [--init_heads copy|random] [--dtype bfloat16]

Where head 1 comes from, per kind (mtp_jax/heads/):
  parallel    Gloeckle et al. 2024 §2 / Meta's layout: the last HF layer is head 1's block, the
              trunk is the layers before it; `copy` starts heads 2..n as copies of that block.
  projection  head 1 is the whole HF model; heads 2..n are residual MLPs.
  sequential  DeepSeek-V3 MTP modules (arXiv 2412.19437 §2.2) after the whole HF model.

`copy` (the default) starts every new head predicting what head 1 predicts, so the first
fine-tuning steps start from the next-token model's loss on shifted targets instead of a
random head's log V: parallel copies the block; projection zeroes each MLP's output matrix
(z + 0 = z); sequential zeroes each depth block's output matrices (attention wo, MLP w2) and
makes eh_proj pass the (normed) trunk state through, so depth k reads head 1's state (up to the
softmax temperature its own output norm sets). `random` keeps the model's own initialiser.
The zeroed matrices still get gradients at step one (their inputs are not zero).
"""

from __future__ import annotations

import os

import jax
import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util

from mtp_jax import config as config_lib
from mtp_jax import heads as heads_lib
from mtp_jax.convert.layouts import check_tensors, llama_entries, param_shapes, read_params
from mtp_jax.convert.readers import Safetensors, read_json
from mtp_jax.convert import families
from mtp_jax.convert.workdir import check_out, prepare_config, tokenizer_path, write_workdir
from mtp_jax.model import build_model

INIT_HEADS = ("copy", "random")


def config_from_hf(hf: dict, n_future: int, heads: str, max_len: int = 0
                   ) -> ml_collections.ConfigDict:
  """base_config() with the model of config.json `hf` and `n_future` heads of kind `heads`."""
  family = families.family_of(hf)
  if heads not in heads_lib.KINDS:
    raise ValueError(f"--heads: got {heads!r}, allowed: "
                     + ", ".join(map(repr, heads_lib.KINDS)))
  if n_future < 2:
    raise ValueError(f"--n_future: must be >= 2 (head 1 is the HF model), got {n_future}")
  c = config_lib.base_config()
  m = c.model
  families.model_fields(hf, m, family)
  m.max_len = max_len or int(hf.get("max_position_embeddings", 4096))
  m.n_future, m.heads.kind = n_future, heads
  # The HF layers are the trunk and head 1's own block, if the kind gives head 1 one (parallel:
  # the last HF layer, with n_layers counting every head's block).
  kind = heads_lib.KINDS[heads]
  m.n_layers += m.n_layers - len(kind.head_params(1)) - kind.n_trunk(m)
  return c


def new_heads(config: ml_collections.ConfigDict, params: dict, init_heads: str) -> dict:
  """params["heads"] with heads 2..n initialised (see the module docstring); head 1's own
  params, if any (parallel blocks[0]), are already in `params`."""
  model = build_model(config)
  a = model.args
  tokens = jnp.zeros((1, 8), jnp.int32)
  # Only the heads subtree is an output, so XLA drops the trunk's initialisers.
  fresh = jax.jit(lambda r: nn.unbox(model.init(r, tokens)["params"])["heads"])
  out = jax.tree.map(np.array, jax.device_get(fresh(jax.random.PRNGKey(config.seed))))
  for path, index in heads_lib.KINDS[a.head_kind].head_params(1):  # head 1's own params
    stack = traverse_util.flatten_dict(out[path[1]])
    for leaf, x_1x_ in traverse_util.flatten_dict(params["heads"][path[1]]).items():
      stack[leaf][index] = x_1x_[index]
    out[path[1]] = traverse_util.unflatten_dict(stack)
  if init_heads == "copy":
    heads_lib.KINDS[a.head_kind].warm_start(out, a)
  return out


def check_init_heads(init_heads: str) -> None:
  if init_heads not in INIT_HEADS:
    raise ValueError(f"--init_heads: got {init_heads!r}, allowed: 'copy', 'random'")


def import_hf(ckpt: str, out: str, *, n_future: int, heads: str, init_heads: str = "copy",
              tokenizer: str = "", max_len: int = 0, dtype: str = "float32"
              ) -> ml_collections.ConfigDict:
  """HF Llama / Qwen2 / Qwen3 / Mistral `ckpt`
  (config.json, model.safetensors or shards with their index) ->
  workdir `out` with `n_future` heads of kind `heads`. Nothing is written unless every tensor
  is there with its shape."""
  check_out(out)
  check_init_heads(init_heads)
  hf = read_json(os.path.join(ckpt, "config.json"), "config.json")
  tok = tokenizer_path(ckpt, tokenizer, parent=False)
  return import_source(hf, Safetensors(ckpt), out, source=ckpt, n_future=n_future, heads=heads,
                       init_heads=init_heads, tokenizer=tok, max_len=max_len, dtype=dtype)


def import_source(hf: dict, reader, out: str, *, source: str, n_future: int, heads: str,
                  init_heads: str, tokenizer: str, max_len: int, dtype: str
                  ) -> ml_collections.ConfigDict:
  """config.json fields `hf` and a tensor `reader` (HF names; keys, shape, get) of checkpoint
  `source` -> workdir `out`; `tokenizer` a path as prepare_config takes it ("" = none)."""
  c = config_from_hf(hf, n_future, heads, max_len)
  prepare_config(c, tokenizer, source)
  args, shapes = param_shapes(c)
  entries = llama_entries(args)
  optional = {k for k in reader.keys() if k.endswith("rotary_emb.inv_freq")}
  if args.tie_embeddings:
    optional.add("lm_head.weight")  # saved by some tied checkpoints; HF ignores it when tied
  check_tensors(reader, entries, shapes, source, families.ARCHITECTURES[c.model.family],
                optional=optional)
  # Fill what the checkpoint holds (head 1's own block, parallel, goes to blocks[0] of a
  # one-block stack: the rest of the stack is new_heads' business).
  filled = {p: s for p, s in shapes.items() if p[0] != "heads"}
  for path, _ in heads_lib.KINDS[args.head_kind].head_params(1):
    filled.update({p: jax.ShapeDtypeStruct((1,) + s.shape[1:], s.dtype)
                   for p, s in shapes.items() if p[:len(path)] == path})
  dt = jnp.dtype(dtype)
  params = read_params(reader, entries, filled, dt)
  params["heads"] = jax.tree.map(lambda x: x.astype(dt), new_heads(c, params, init_heads))
  write_workdir(out, c, params)
  return c
