"""DeepSeek-V3-style sequential MTP at the Llama-2-7B shape: one MTP depth (n_future 2, as
DeepSeek-V3 trains it), arXiv 2412.19437 §2.2, for a TPU pod slice.

The 32-layer trunk is the whole next-token model; the depth module adds one block and the 2d->d
eh_proj (~0.24B params) and shares the embedding and output matrix. Loss: main + lambda / D *
depth loss, lambda 0.3 (DeepSeek-V3's value for the first 10T tokens), preset as in the released
weights ([emb; h], trunk state after the final norm, the depth's own output norm). Shape and
training fields as paper_7b_n4.py. Check the fit first:

    python experiments/plan_memory.py --config configs/paper_deepseek_seq.py --devices 256 \
        --mesh fsdp=256

(Its n_future = 1 line there is the 32-layer model without the depth, so not matched params.)
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
  m.tie_embeddings = False
  m.n_future = 2
  m.heads.kind = "sequential"
  m.heads.seq_preset = "deepseek_v3"
  m.dtype = "bfloat16"
  m.remat_policy = "full"

  c.loss.head_weights = "deepseek"
  c.loss.mtp_lambda = 0.3
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
