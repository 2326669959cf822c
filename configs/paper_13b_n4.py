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

from mtp_jax.config import base_config


def get_config():
  c = base_config()
  m = c.model
  m.vocab_size = 32000
  m.d_model = 5120
  m.n_layers = 40
  m.n_heads = 40
  m.n_kv_heads = 40
  m.d_ff = 13824
  m.max_len = 4096
  m.norm_eps = 1e-5
  m.tie_embeddings = False
  m.n_future = 4
  m.heads.kind = "parallel"
  m.heads.parallel_stack = "scan"  # one head block alive at a time (plan_memory: vmap is far bigger)
  m.dtype = "bfloat16"
  m.remat_policy = "full"

  c.loss.token_chunks = 4

  c.data.tokenizer = "sentencepiece"
  c.data.spm_path = "tokenizer.model"  # Llama 2's SentencePiece model: point this at your copy
  c.data.seq_len = 4096

  c.train.batch_size = 1024
  c.train.grad_accum = 4
  c.train.steps = 50000
  c.train.eval_every = 1000
  c.train.checkpoint_every = 1000

  c.optim.lr = 3e-4
  c.optim.warmup_steps = 2000

  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  return c
