"""The built-in default: a byte-level code model with 4 parallel heads (Gloeckle et al. 2024).

d_model 256, 6 blocks: 2 trunk blocks and 4 head blocks (head 1's + 3 extra heads', Meta's
layout; every head is 3 blocks deep), seq_len 256: trainable on 2 CPU cores in minutes. Same
parameter count as `ntp.py`, the n_future = 1 baseline.
"""

from mtp_jax.config import base_config


def get_config():
  c = base_config()
  c.model.n_future = 4
  c.model.heads.kind = "parallel"
  return c
