"""Llama-2-7B shape with 4 parallel heads (Gloeckle et al. 2024 §3: the 6.7B models, n = 4), for
a TPU pod slice.

d_model 4096, 32 layers counting the head blocks (28 trunk + 4 head blocks: the parameters of
the 32-layer next-token model, which `--config.model.n_future=1` gives), 32 attention heads
(no GQA), SwiGLU 11008, untied embeddings, vocab 32000 (Llama 2's SentencePiece model), seq
4096, bfloat16 compute (params and optimizer state stay float32). 6.74B parameters.

Mesh: FSDP over every chip (data 1, fsdp -1, tensor 1). Params, gradients and both Adam moments
are ~108 GB in float32 all told, ~0.42 GB per chip on 256 chips, so activations decide the
fit: full remat and one 4096-token sequence per chip per micro-batch. A 4M-token step (Llama 2's
batch) is batch 1024 with grad_accum 4 on 256 chips. Check a slice before renting it:

    python experiments/plan_memory.py --config configs/paper_7b_n4.py --devices 256 --mesh fsdp=256

Past ~512 chips, or with a batch too small to give every chip a row, add tensor parallelism
(`--config.mesh.tensor=4`, mesh.fsdp stays -1).
"""

from mtp_jax.config import base_config


def get_config():
  c = base_config()
  m = c.model
  m.vocab_size = 32000
  m.d_model = 4096
  m.n_layers = 32
  m.n_heads = 32
  m.n_kv_heads = 32
  m.d_ff = 11008
  m.max_len = 4096
  m.norm_eps = 1e-5
  m.rope_theta = 10000.0
  m.tie_embeddings = False
  m.n_future = 4
  m.heads.kind = "parallel"
  # One head block alive at a time (plan_memory: vmap is far bigger).
  m.heads.parallel_stack = "scan"
  m.dtype = "bfloat16"
  # "dots_with_no_batch_dims_saveable" is faster where memory allows (plan_memory tells).
  m.remat_policy = "full"

  c.loss.token_chunks = 4  # one head's logits in 1024-token tiles: [1, 1024, 32000] f32 a chip

  c.data.tokenizer = "sentencepiece"
  c.data.spm_path = "tokenizer.model"  # Llama 2's SentencePiece model: point this at your copy
  c.data.seq_len = 4096

  c.train.batch_size = 1024  # 4M tokens a step
  c.train.grad_accum = 4  # micro-batch 256: one sequence per chip on 256 chips
  c.train.steps = 50000
  c.train.log_every = 10
  c.train.eval_every = 1000
  c.train.checkpoint_every = 1000

  c.optim.lr = 3e-4
  c.optim.warmup_steps = 2000
  c.optim.weight_decay = 0.1
  c.optim.grad_clip = 1.0

  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  return c
