"""Model FLOPs per token, peak FLOP/s per device, and model FLOPs utilisation (MFU).

Counting (PaLM, Chowdhery et al. 2022, appendix B): 2 FLOPs per multiply-add of every matmul in
the forward pass, x3 for a train step (the backward pass costs twice the forward). With
`optim.trainable = "heads"` only heads 2..n are trained: the frozen trunk and head 1 run their
forward pass alone (no weight gradient, and no input gradient since nothing below them is
trained), heads 2..n and their attention x3, and their unembedding x2 (the input gradient the
heads need, no weight gradient of the frozen matrix). A trained head's input gradient into the
frozen trunk output is not needed either but stays counted, as full training counts the first
block's; head 1's slot of a parallel stack, whose backward XLA computes as zeros, is not. Not
counted:
norms, RoPE, softmax, the SiLU gate, the embedding lookup (a gather), the optimizer update, and
any recomputation under remat: these are *model* FLOPs, so a remat policy lowers MFU instead of
raising the count. Attention scores and values count the full S x S per layer (4 * d_model * S
per token and attention block forward, PaLM's 12 * L * d * S per train token) unless
`causal_half=True`, which counts only the s <= t half that a causal flash kernel computes.

For the training loop (once at start, then per log line):

    fpt = flops.flops_per_token(config)["total"]          # train step FLOPs per token
    peak, source = flops.peak_flops_per_device(config.model.dtype)
    mfu = flops.mfu(tokens_per_second, fpt, peak, jax.device_count())

where tokens_per_second counts input positions (batch * seq_len per step), each of which trains
every head.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mtp_jax import heads as heads_lib
from mtp_jax.model_args import DTYPES

# Dense (no structured sparsity) peak FLOP/s per chip: (bfloat16, float32). The float32 column
# is what JAX's default matmul precision reaches with float32 inputs: TF32 tensor cores on
# Ampere and later NVIDIA GPUs, one bf16 MXU pass on TPUs (docs.jax.dev "Matmul precision":
# "bfloat16 on TPU, TF32 on recent GPUs"); `jax.default_matmul_precision("highest")` is slower.
# NVIDIA quotes tensor-core figures with 2:4 sparsity; the dense figure is half.
_NVIDIA_H100 = "NVIDIA H100 datasheet (resources.nvidia.com/en-us-tensor-core), sparse / 2"
_NVIDIA_H200 = "NVIDIA H200 product page (nvidia.com/en-us/data-center/h200), SXM, sparse / 2"
_NVIDIA_A100 = "NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), dense"
_TPU = "Cloud TPU docs (cloud.google.com/tpu/docs/{}), peak compute per chip (bf16)"
PEAK_FLOPS: dict[str, tuple[float, float, str]] = {
    # CUDA device names, as jax.devices()[0].device_kind reports them.
    "NVIDIA H100 80GB HBM3": (989.4e12, 494.7e12, _NVIDIA_H100 + ", SXM5"),
    "NVIDIA H100 PCIe": (756.0e12, 378.0e12, _NVIDIA_H100 + ", PCIe"),
    # The H200 NVL (600 W) reports the same name and peaks ~15% lower (835 TFLOP/s bf16).
    "NVIDIA H200": (989.4e12, 494.7e12, _NVIDIA_H200),
    "NVIDIA A100-SXM4-40GB": (312e12, 156e12, _NVIDIA_A100),
    "NVIDIA A100-SXM4-80GB": (312e12, 156e12, _NVIDIA_A100),
    "NVIDIA A100-PCIE-40GB": (312e12, 156e12, _NVIDIA_A100),
    "NVIDIA A100 80GB PCIe": (312e12, 156e12, _NVIDIA_A100),
    # TPU device kinds as JAX names them (jax/_src/pallas/mosaic maps "TPU v5 lite" to v5e,
    # "TPU v5" to v5p, "TPU v6 lite" to v6e); the marketing names are kept as aliases.
    "TPU v4": (275e12, 275e12, _TPU.format("v4")),
    "TPU v5 lite": (197e12, 197e12, _TPU.format("v5e")),
    "TPU v5e": (197e12, 197e12, _TPU.format("v5e")),
    "TPU v5": (459e12, 459e12, _TPU.format("v5p")),
    "TPU v5p": (459e12, 459e12, _TPU.format("v5p")),
    "TPU v6 lite": (918e12, 918e12, _TPU.format("v6e")),
    "TPU v6e": (918e12, 918e12, _TPU.format("v6e")),
}


def _block(d: int, n_heads: int, n_kv_heads: int, d_ff: int, head_dim: int = 0,
           qkv_bias: bool = False) -> int:
  """Forward FLOPs per token of one pre-norm Llama block, attention scores aside: q and o
  (d x n_heads * head_dim each), k and v (d x n_kv_heads * head_dim each, GQA), SwiGLU's three
  d x d_ff; with q/k/v biases (Qwen2) their adds, one FLOP per output. head_dim 0: d // n_heads."""
  e = head_dim or d // n_heads
  q, kv = n_heads * e, n_kv_heads * e
  return 2 * (2 * d * q + 2 * d * kv + 3 * d * d_ff) + (q + 2 * kv if qkv_bias else 0)


def flops_per_token(config: ml_collections.ConfigDict, *, train: bool = True,
                    causal_half: bool = False) -> dict[str, float]:
  """FLOPs per input token of one forward (train=False) or train step (train=True, x3).

  Returns {"trunk", "heads", "attention", "unembedding", "total"}: "trunk" and "heads" are the
  blocks' projection and MLP matmuls, "attention" the scores and values of every attention
  block (trunk and heads) at sequence length data.seq_len, "unembedding" d_model x vocab once per
  head, vocab the real model.vocab_size: the pad columns of model.vocab_multiple are computed
  but are no model FLOPs (MFU counts the model's work, not the padding's). The head kind counts
  its own weights' FLOPs and attention blocks (`HeadKind.flops_per_token`) and says how many
  trunk blocks it leaves (`HeadKind.n_trunk`). ValueError for a kind that does not count them.
  """
  m = config.model
  d, n, S = m.d_model, m.n_future, config.data.seq_len
  block = _block(d, m.n_heads, m.n_kv_heads, m.d_ff, m.head_dim, m.qkv_bias)
  q_width = m.n_heads * (m.head_dim or d // m.n_heads)
  kind = heads_lib.KINDS.get(m.heads.kind)
  if kind is None:
    raise ValueError(f"config.model.heads.kind: got {m.heads.kind!r}, allowed: "
                     + ", ".join(map(repr, heads_lib.KINDS)))
  try:
    heads, head_blocks = kind.flops_per_token(m, block)
    m1 = m.copy_and_resolve_references()
    m1.n_future = 1
    heads_1, head_blocks_1 = kind.flops_per_token(m1, block)  # head 1's share
  except NotImplementedError as e:
    raise ValueError(str(e)) from None
  n_trunk = kind.n_trunk(m)
  W = min(m.sliding_window or S, S)  # keys a query can see at most (Mistral's window)
  # causal_half: query t sees min(t + 1, W) keys, averaged over t (S / 2 without a window)
  keys = (sum(min(t + 1, W) for t in range(S)) / S if W < S else S / 2) if causal_half else W
  attention = 4 * q_width * keys  # QK^T and PV: 2 FLOPs x head_dim x keys, n_heads, twice
  unembed = 2 * d * m.vocab_size
  # (frozen: forward only, trained: forward and backward) FLOPs of each part
  if not train:
    parts = {"trunk": (n_trunk * block, 0), "heads": (heads, 0),
             "attention": ((n_trunk + head_blocks) * attention, 0),
             "unembedding": (n * unembed, 0)}
  elif config.optim.trainable == "heads":
    parts = {"trunk": (n_trunk * block, 0), "heads": (heads_1, heads - heads_1),
             "attention": ((n_trunk + head_blocks_1) * attention,
                           (head_blocks - head_blocks_1) * attention),
             "unembedding": (unembed + 2 * (n - 1) * unembed, 0)}  # head 1 fwd; 2..n fwd + dx
  else:
    parts = {"trunk": (0, n_trunk * block), "heads": (0, heads),
             "attention": (0, (n_trunk + head_blocks) * attention),
             "unembedding": (0, n * unembed)}
  out = {k: float(frozen + 3 * trained) for k, (frozen, trained) in parts.items()}
  out["total"] = sum(out.values())
  return out


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float | None,
        n_devices: int = 1) -> float | None:
  """Model FLOPs utilisation: achieved model FLOP/s over the devices' summed peak (None when the
  peak is unknown). tokens_per_second is the global rate over all n_devices."""
  if not peak_flops:
    return None
  return tokens_per_second * flops_per_token / (peak_flops * n_devices)


def _dtype_name(dtype) -> str:
  name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
  if name not in DTYPES:
    raise ValueError(f"dtype: got {dtype!r}, allowed: {', '.join(map(repr, DTYPES))}")
  return name


@functools.cache
def _measure(device, dtype: str, n: int, reps: int) -> float:
  if device.platform == "cpu":  # numpy's draw: jax.random compiles a program first (~0.3 s)
    x = np.random.default_rng(0).standard_normal((n, n), np.float32).astype(jnp.dtype(dtype))
  else:
    x = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.dtype(dtype))
  x = jax.device_put(x, device)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(x, x))
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(x, x))
    best = min(best, time.perf_counter() - t)
  return 2 * n ** 3 / best


def measured_matmul_peak(dtype="float32", device=None, n: int | None = None,
                         reps: int = 5) -> float:
  """FLOP/s of the best of `reps` jitted n x n matmuls (n = 1024 on CPU, 8192 elsewhere),
  measured once per process and (device, dtype, n)."""
  device = device or jax.devices()[0]
  n = n or (1024 if device.platform == "cpu" else 8192)
  return _measure(device, _dtype_name(dtype), n, reps)


def peak_flops_per_device(dtype="float32", device=None) -> tuple[float, str]:
  """(peak FLOP/s of one device for matmuls in `dtype`, where the figure comes from): the
  datasheet table above for a known device kind, else (CPUs, unlisted accelerators) a measured
  matmul peak. Call once at start; the measurement is cached."""
  name = _dtype_name(dtype)
  device = device or jax.devices()[0]
  kind = device.device_kind
  if kind in PEAK_FLOPS:
    bf16, f32, source = PEAK_FLOPS[kind]
    return (bf16 if name == "bfloat16" else f32), f"{kind}, {name}: {source}"
  n = 1024 if device.platform == "cpu" else 8192
  return (measured_matmul_peak(name, device, n),
          f"{kind}, {name}: measured, best of 5 jitted {n}x{n} matmuls (not in flops.PEAK_FLOPS)")
