"""Hugging Face model families mtp_jax's blocks compute: config.json <-> config.model.

  llama    LlamaForCausalLM (Llama 2, 3.x with `llama3` or `linear` RoPE scaling, TinyLlama,
           CodeLlama, DeepSeek-Coder)
  qwen2    Qwen2ForCausalLM (Qwen2.5, Qwen2.5-Coder): q/k/v biases, often tied embeddings
  qwen3    Qwen3ForCausalLM: RMSNorm over head_dim on q and k before RoPE, head_dim of its own
  mistral  MistralForCausalLM: a sliding window (Mistral 7B v0.1; none from v0.2 on)

Reads both transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`) spellings.
What the blocks cannot compute is one `--ckpt: config.json FIELD ...` line: another family,
MoE, biases on o_proj or the MLP, another activation, unknown RoPE types, partial rotary,
sliding windows on some layers only.
"""

from __future__ import annotations

import ml_collections

from mtp_jax.model_args import FAMILIES

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
assert tuple(ARCHITECTURES) == FAMILIES


def _refuse(field: str, msg: str):
  raise ValueError(f"--ckpt: config.json {field}: {msg}")


def family_of(hf: dict) -> str:
  """The family of a from-hf checkpoint's config.json (model_type and architectures agree)."""
  model_type, arch = hf.get("model_type"), hf.get("architectures") or []
  if model_type not in ARCHITECTURES or arch not in ([], [ARCHITECTURES[model_type]]):
    _refuse("architectures", f"{', '.join(arch) or 'none'} (model_type {model_type!r}); "
            f"from-hf reads {', '.join(ARCHITECTURES.values())}")
  return model_type


def _rope_fields(hf: dict, m: ml_collections.ConfigDict) -> None:
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})  # transformers 5 / 4
  field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
  if any(isinstance(v, dict) for v in rope.values()):
    _refuse(field, "RoPE parameters per layer type; mtp_jax has one RoPE for every layer")
  kind = rope.get("rope_type", rope.get("type", "default"))
  m.rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
  if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0) != 1.0:
    _refuse(f"{field}.partial_rotary_factor", "partial rotary embeddings are not supported")
  if kind == "default":
    return
  if kind not in ("linear", "llama3", "yarn"):
    _refuse(f"{field}.rope_type", f"{kind!r}; mtp_jax has default, linear, llama3, yarn")
  original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
  factor = rope.get("factor") or (kind == "yarn" and int(hf["max_position_embeddings"]) / original)
  if not factor:
    _refuse(f"{field}.factor", f"{kind} RoPE scaling needs a factor")
  m.rope_scaling, m.rope_factor = kind, float(factor)
  if kind == "llama3":
    m.rope_low_freq_factor = float(rope["low_freq_factor"])
    m.rope_high_freq_factor = float(rope["high_freq_factor"])
  if kind in ("llama3", "yarn"):
    m.rope_original_max_len = int(original)
  if kind == "yarn":
    for key in ("mscale", "mscale_all_dim"):
      if rope.get(key):
        _refuse(f"{field}.{key}", "DeepSeek's yarn mscale is not supported")
    if rope.get("truncate", True) is False:
      _refuse(f"{field}.truncate", "false is not supported")
    m.rope_beta_fast = float(rope.get("beta_fast") or 32.0)
    m.rope_beta_slow = float(rope.get("beta_slow") or 1.0)
    m.rope_attention_factor = float(rope.get("attention_factor") or 0.0)


def _window(hf: dict, family: str) -> int:
  """Mistral's sliding_window; Qwen's only with use_sliding_window, on every layer."""
  window = int(hf.get("sliding_window") or 0)
  if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
    window = 0
  if family == "llama":
    window = 0
  types = set(hf.get("layer_types") or [])
  if types - {"full_attention", "sliding_attention"} or len(types) > 1:
    _refuse("layer_types", f"{sorted(types)} (a sliding window on some layers only: "
            "max_window_layers < num_hidden_layers); mtp_jax's layers all attend alike")
  if types == {"full_attention"} and family != "mistral":
    window = 0
  return window


def model_fields(hf: dict, m: ml_collections.ConfigDict, family: str = "llama") -> None:
  """config.model `m` from config.json `hf` of `family` (DeepSeek's dense part reads as llama):
  sizes, GQA, head_dim, norm eps, RoPE and its scaling, biases, q/k norms, window, ties."""
  if hf.get("hidden_act", "silu") != "silu":
    _refuse("hidden_act", f"{hf['hidden_act']!r}; mtp_jax's MLP is SwiGLU (silu)")
  if hf.get("mlp_bias"):
    _refuse("mlp_bias", "MLP biases are not supported")
  if hf.get("attention_bias"):
    _refuse("attention_bias", "biases on o_proj are not supported (Qwen2's q/k/v biases are)")
  for key in ("num_experts", "num_local_experts", "n_routed_experts"):
    if hf.get(key):
      _refuse(key, "Mixture-of-Experts blocks are not supported")
  try:
    m.d_model, m.n_layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    m.n_heads, m.d_ff = int(hf["num_attention_heads"]), int(hf["intermediate_size"])
    m.vocab_size = int(hf["vocab_size"])
  except KeyError as e:
    raise ValueError(f"--ckpt: config.json has no {e.args[0]!r}") from None
  head_dim = int(hf.get("head_dim") or 0)
  m.head_dim = 0 if head_dim in (0, m.d_model // m.n_heads) and not m.d_model % m.n_heads \
      else head_dim
  m.n_kv_heads = int(hf.get("num_key_value_heads") or m.n_heads)
  m.norm_eps = float(hf.get("rms_norm_eps", 1e-6))
  m.tie_embeddings = bool(hf.get("tie_word_embeddings", False))
  _rope_fields(hf, m)
  m.qkv_bias, m.qk_norm = family == "qwen2", family == "qwen3"
  m.sliding_window = _window(hf, family)
  m.family = family


def export_config(a, family: str) -> dict:
  """config.json fields of `family` for ModelArgs `a` (sizes, RoPE, biases, window); refuses a
  model its family's architecture cannot express."""
  fits = {"llama": not (a.qkv_bias or a.qk_norm or a.sliding_window),
          "qwen2": a.qkv_bias and not a.qk_norm, "qwen3": a.qk_norm and not a.qkv_bias,
          "mistral": not (a.qkv_bias or a.qk_norm)}[family]
  if not fits:
    raise ValueError(f"--workdir: model.family {family!r} has no architecture with qkv_bias "
                     f"{a.qkv_bias}, qk_norm {a.qk_norm}, sliding_window {a.sliding_window}")
  rope = {"rope_type": "default" if a.rope_scaling == "none" else a.rope_scaling,
          "rope_theta": a.rope_theta}
  if a.rope_scaling != "none":
    rope["factor"] = a.rope_factor
  if a.rope_scaling == "llama3":
    rope.update(low_freq_factor=a.rope_low_freq_factor, high_freq_factor=a.rope_high_freq_factor)
  if a.rope_scaling in ("llama3", "yarn"):
    rope["original_max_position_embeddings"] = a.rope_original_max_len
  if a.rope_scaling == "yarn":
    rope.update(beta_fast=a.rope_beta_fast, beta_slow=a.rope_beta_slow)
    if a.rope_attention_factor:
      rope["attention_factor"] = a.rope_attention_factor
  hf = {"architectures": [ARCHITECTURES[family]], "model_type": family,
        "rope_theta": a.rope_theta, "rope_parameters": rope}
  if family in ("llama", "qwen3"):
    hf.update(attention_bias=False)
  if family == "llama":
    hf.update(mlp_bias=False)
  if family in ("qwen2", "qwen3"):
    hf.update(use_sliding_window=bool(a.sliding_window), sliding_window=a.sliding_window or None,
              max_window_layers=0)
  if family == "mistral":
    hf.update(sliding_window=a.sliding_window or None)
  return hf
