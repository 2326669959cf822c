"""Llama-2-13B shape with 4 parallel heads (Gloeckle et al. 2024 §3 and Table S7: 13B models
trained from scratch on code, n = 4), for a TPU pod slice. Training fields as paper_7b_n4.py.

d_model 5120, 40 layers counting the head blocks (36 trunk + 4 head blocks: the parameters of
the 40-layer next-token model), 40 attention heads (no GQA), SwiGLU 13824, untied embeddings,
vocab 32000, seq 4096, bfloat16 compute. 13.0B parameters, ~208 GB of float32 params,
gradients and Adam moments all told: ~0.8 GB per chip on 256 chips.

Mesh: FSDP over every chip (data 1, fsdp -1, tensor 1), full remat, one sequence per chip per
micro-batch (batch 1024 = 4M tokens, grad_accum 4, on 256 chips). Check the fit first:

    python experiments/plan_memory.py --config configs/paper_13b_n4.py --devices 256 --mesh fsdp=256
"""

import os

from mtp_jax.config import load_file


def get_config():
  c = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper_7b_n4.py"))
  m = c.model
  m.d_model = 5120
  m.n_layers = 40
  m.n_heads = 40
  m.n_kv_heads = 40
  m.d_ff = 13824
  return c
