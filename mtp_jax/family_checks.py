"""Validation of the model-family fields of config.model (head_dim, RoPE scaling, sliding
window; layers.Attention computes them): JAX-free, called by config.validate with its one-line
failure helpers."""

from __future__ import annotations

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # transformers' rope_type names
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # HF architectures (convert/families.py)


def validate_family(c, fail, choice) -> None:
  """head_dim, RoPE scaling, sliding window (the model-family fields)."""
  m = c.model
  if m.head_dim < 0 or m.head_dim % 2:
    fail("model.head_dim", f"must be 0 (d_model // n_heads) or an even size, got {m.head_dim}")
  if not m.head_dim and m.d_model % m.n_heads:
    fail("model.n_heads", f"must divide model.d_model ({m.d_model}), got {m.n_heads}")
  if not m.head_dim and (m.d_model // m.n_heads) % 2:
    fail("model.n_heads", f"head size d_model/n_heads = {m.d_model // m.n_heads} must be even "
          "for RoPE")
  choice(c, "model.rope_scaling", ROPE_SCALINGS)
  choice(c, "model.family", FAMILIES)
  if m.rope_original_max_len < 1:
    fail("model.rope_original_max_len", f"must be >= 1, got {m.rope_original_max_len}")
  if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
    fail("model.rope_high_freq_factor", f"must exceed model.rope_low_freq_factor "
          f"({m.rope_low_freq_factor}), got {m.rope_high_freq_factor}")
  if m.sliding_window < 0:
    fail("model.sliding_window", f"must be >= 0 (0: no window), got {m.sliding_window}")
