"""Llama-3.2-1B (its config.json values: LlamaForCausalLM, llama3 RoPE scaling, tied
embeddings, 32 heads of 64, 8 kv heads) with 4 parallel heads, set up as configs/finetune.py
fine-tunes an import (heads only, bf16, full remat, 2048 tokens): what experiments/plan_memory.py
compiles to size the fine-tuning. A real run imports the checkpoint instead
(docs/finetuning_families.md):

  python experiments/plan_memory.py --config configs/llama32_1b_n4.py --devices 1 \\
      --no_baseline --hbm_gib 80 --json experiments/results/plan_llama32_1b_n4.json
"""

from mtp_jax.convert.from_hf import config_from_hf

HF_CONFIG = {  # huggingface.co/meta-llama/Llama-3.2-1B config.json
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "head_dim": 64, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256,
    "bos_token_id": 128000, "eos_token_id": 128001,
}


def get_config():
  c = config_from_hf(HF_CONFIG, n_future=4, heads="parallel", max_len=2048)
  c.optim.trainable, c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay = "heads", 1e-3, 20, 0.0
  c.train.batch_size, c.data.seq_len = 8, 2048
  c.model.dtype, c.model.remat_policy, c.model.heads.parallel_stack = "bfloat16", "full", "scan"
  c.loss.token_chunks = 8
  return c
