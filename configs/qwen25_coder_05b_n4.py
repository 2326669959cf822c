"""Qwen2.5-Coder-0.5B (its config.json values: Qwen2ForCausalLM, q/k/v biases, tied
embeddings, 14 heads of 64, 2 kv heads) with 4 parallel heads, set up as configs/finetune.py
fine-tunes an import (heads only, bf16, full remat, 2048 tokens): what experiments/plan_memory.py
compiles to size the fine-tuning. A real run imports the checkpoint instead
(docs/finetuning_families.md):

  python experiments/plan_memory.py --config configs/qwen25_coder_05b_n4.py --devices 1 \\
      --no_baseline --hbm_gib 80 --json experiments/results/plan_qwen25_coder_05b_n4.json
"""

from mtp_jax.convert.from_hf import config_from_hf

HF_CONFIG = {  # huggingface.co/Qwen/Qwen2.5-Coder-0.5B config.json
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "max_window_layers": 24, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
    "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151643,
}


def get_config():
  c = config_from_hf(HF_CONFIG, n_future=4, heads="parallel", max_len=2048)
  c.optim.trainable, c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay = "heads", 1e-3, 20, 0.0
  c.train.batch_size, c.data.seq_len = 8, 2048
  c.model.dtype, c.model.remat_policy, c.model.heads.parallel_stack = "bfloat16", "full", "scan"
  c.loss.token_chunks = 8
  return c
