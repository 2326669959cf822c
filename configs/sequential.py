"""DeepSeek-V3 sequential MTP (arXiv 2412.19437 §2.2): 3 chained depths on the 6-block trunk,
loss = main + lambda/D * sum of depth losses, preset as in the released weights."""

from mtp_jax.config import base_config


def get_config():
  c = base_config()
  c.model.n_future = 4
  c.model.heads.kind = "sequential"
  c.model.heads.seq_preset = "deepseek_v3"
  c.loss.head_weights = "deepseek"
  return c
