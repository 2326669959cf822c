"""`ModelArgs`: every field of `config.model`, declared and defaulted once, JAX-free.

`config.base_config().model` is built from this class (a field under `model.heads` when its
metadata says `heads=True`, `head_kind` as `model.heads.kind`), and `model.model_args(config)`
builds the hashable instance the modules read (a jit static argument). Imports nothing from
mtp_jax and no JAX, so reading a config loads neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def padded_vocab(vocab_size: int, vocab_multiple: int) -> int:
  """vocab_size rounded up to a multiple of vocab_multiple: the embedding's rows."""
  return -(-int(vocab_size) // int(vocab_multiple)) * int(vocab_multiple)


# The default head kind's name: the one place outside mtp_jax/heads/ that names a kind (JAX-free,
# so the config can default to it without loading the registry; validation checks it is there).
DEFAULT_HEAD_KIND = "parallel"


# Allowed values of the config.model fields with a fixed set (on the field below; config.base
# collects them for config.validation).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("auto", "einsum", "cpu", "xla", "cudnn", "splash")  # mtp_jax/attention.py
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # transformers' rope_type names
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # HF architectures (convert/families.py)


def _heads(default):
  """A field of config.model.heads (a head kind's own field; the kind checks its values)."""
  return dataclasses.field(default=default, metadata={"heads": True})


def _one_of(default, allowed: tuple):
  """A field whose value is one of `allowed`."""
  return dataclasses.field(default=default, metadata={"allowed": allowed})


def _float(default: float, words: str, in_range: Callable[[float], bool]):
  """A float field: a finite number in the range `in_range` tests (`words` says it)."""
  return dataclasses.field(default=default, metadata={"range": (words, in_range)})


def _positive(x):
  return x > 0


@dataclasses.dataclass(frozen=True)
class ModelArgs:
  """Every field of config.model, flat (model.heads.kind as head_kind), plus n_trunk."""
  vocab_size: int = 259  # byte tokenizer: 256 bytes + pad, bos, eos
  # The embedding and unembedding have vocab_size rounded up to a multiple of this many rows
  # (padded_vocab): 259 -> 384 splits over `tensor` and fills the MXU / tensor cores. Pad
  # logits are masked out of the loss and decoding (model.mask_pad_logits). A workdir saved
  # before the field existed loads with 1 (config.load_json): its embedding is unpadded.
  vocab_multiple: int = 128
  d_model: int = 256
  n_layers: int = 6  # counts the parallel head blocks (matched parameters, Gloeckle §3)
  n_heads: int = 8  # attention heads
  n_kv_heads: int = 4
  d_ff: int = 768  # SwiGLU hidden size
  max_len: int = 1024  # longest sequence (prompt + completion) the model accepts
  rope_theta: float = _float(10000.0, "> 0", _positive)
  norm_eps: float = _float(1e-5, "> 0", _positive)
  tie_embeddings: bool = True
  n_future: int = 1
  remat_policy: str = _one_of("none", REMAT_POLICIES)
  scan_layers: bool = True
  # Trunk layers per iteration of the scanned loop (scan_layers; params stacked either way):
  # 0 = auto: the backend's choice (mtp_jax/backends): every layer, no loop, when compiled for
  # one CPU device (XLA:CPU copies a loop's stacked residuals: docs/cpu_speed.md), else 1
  # (compile time flat in depth); k: k per iteration.
  scan_unroll: int = 0
  # q|k|v (and the MLP's w1|w3) as one matmul against their kernels concatenated ("on"), or one
  # matmul each ("off"); "auto": on when compiled for one CPU device (one wide GEMM beats three
  # narrow ones there: docs/cpu_speed.md), off elsewhere (under a tensor-parallel mesh the
  # concatenation would move kernel shards). Same parameters either way.
  fuse_projections: str = _one_of("auto", ("auto", "on", "off"))
  # float32 matmuls (dense layers, the loss's logits) of a program compiled for one CPU device:
  # by Intel MKL's sgemm through an XLA FFI call ("mkl": the MKL inside PyTorch's CPU wheel,
  # mtp_jax/backends/cpu/gemm.py; an error where there is none) or by XLA's own dot ("xla");
  # "auto": mkl on Intel CPUs where it is at hand (faster there: docs/cpu_speed.md; other
  # vendors' CPUs, unmeasured with it, keep XLA's dot). Other
  # targets (a mesh, an accelerator): XLA's. Same parameters, same maths up to float32 summation
  # order.
  cpu_matmul: str = _one_of("auto", ("auto", "xla", "mkl"))
  # Compute dtype (params stay float32): a name in the config, a jnp dtype in the instance
  # model.model_args builds.
  dtype: Any = _one_of("float32", DTYPES)
  attention_impl: str = _one_of("auto", ATTENTION_IMPLS)  # mtp_jax/attention.py
  # Model families (layers.Attention; docs/finetuning_families.md): defaults are a plain Llama.
  qkv_bias: bool = False  # biases on q, k, v (Qwen2)
  qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
  # 0: d_model // n_heads (resolved in the instance); else its own size (Qwen3).
  head_dim: int = 0
  sliding_window: int = 0  # > 0: a query sees the last this-many positions (Mistral)
  family: str = _one_of("llama", FAMILIES)  # the HF architecture `convert to-hf` writes
  # RoPE scaling as transformers' modeling_rope_utils: none, linear, llama3, yarn.
  rope_scaling: str = _one_of("none", ROPE_SCALINGS)
  rope_factor: float = _float(1.0, ">= 1", lambda x: x >= 1)  # linear, llama3, yarn
  rope_low_freq_factor: float = _float(1.0, "> 0", _positive)  # llama3
  rope_high_freq_factor: float = _float(4.0, "> 0", _positive)  # llama3
  rope_original_max_len: int = 8192  # llama3, yarn: the pretraining context
  rope_beta_fast: float = _float(32.0, "> 0", _positive)  # yarn
  rope_beta_slow: float = _float(1.0, "> 0", _positive)  # yarn
  rope_attention_factor: float = _float(0.0, ">= 0 (0: from rope_factor)", lambda x: x >= 0)
  # yarn: 0 = 0.1 ln(rope_factor) + 1
  head_kind: str = _heads(DEFAULT_HEAD_KIND)  # config.model.heads.kind: a name in heads.KINDS
  # Parallel head blocks: "vmap" runs them side by side (fast on small models); "scan" runs one
  # at a time, so only one head's activations are alive (what large models need: plan_memory).
  parallel_stack: str = _heads("vmap")
  # Sequential heads (the kind's `presets`: who does which). The preset sets the three fields
  # below unless "" (custom).
  seq_preset: str = _heads("deepseek_v3")
  seq_concat: str = _heads("emb_first")
  seq_trunk_state: str = _heads("post_norm")
  seq_output_norm: str = _heads("per_module")
  # Not a config field: the trunk blocks the head kind leaves (HeadKind.n_trunk).
  n_trunk: int = dataclasses.field(default=0, metadata={"derived": True})

  def __post_init__(self):
    if not self.head_dim:  # the config's 0: d_model // n_heads
      object.__setattr__(self, "head_dim", self.d_model // self.n_heads)

  @property
  def padded_vocab(self) -> int:
    """Rows of the embedding (columns of the unembedding): ids >= vocab_size are padding."""
    return padded_vocab(self.vocab_size, self.vocab_multiple)

  @classmethod
  def config_fields(cls) -> list[tuple[str, str, Any]]:
    """(group, name in config.model[.heads], default) of every config field: group "" for
    config.model, "heads" for config.model.heads."""
    out = []
    for f in dataclasses.fields(cls):
      if f.metadata.get("derived"):
        continue
      heads = f.metadata.get("heads", False)
      out.append(("heads" if heads else "", "kind" if f.name == "head_kind" else f.name,
                  f.default))
    return out

  @classmethod
  def rules(cls, key: str) -> dict[str, Any]:
    """{"model.FIELD": the field's `key` metadata ("allowed": a tuple, "range": (words, test))}
    for the config.model fields that declare one."""
    return {f"model.{f.name}": f.metadata[key] for f in dataclasses.fields(cls)
            if key in f.metadata}

  @classmethod
  def from_config(cls, m, **derived) -> ModelArgs:
    """The ModelArgs of a validated config.model `m` (fields it does not know are ignored),
    with `derived` (n_trunk, dtype, a preset's fields) taking precedence; lists become
    tuples."""
    flat = {k: v for k, v in m.items() if k != "heads"}
    flat.update({"head_kind" if k == "kind" else k: v for k, v in m.heads.items()})
    flat.update(derived)
    flat = {k: tuple(v) if isinstance(v, list) else v for k, v in flat.items()}
    return cls(**{f.name: flat[f.name] for f in dataclasses.fields(cls)})
