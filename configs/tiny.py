"""A tiny model for smoke tests and CI: seconds per run on one CPU core. n_future 2, parallel."""

from mtp_jax.config import base_config


def get_config():
  c = base_config()
  c.model.d_model = 32
  c.model.n_layers = 3
  c.model.n_heads = 2
  c.model.n_kv_heads = 1
  c.model.d_ff = 64
  c.model.max_len = 128
  c.model.n_future = 2
  c.data.seq_len = 32
  c.train.batch_size = 4
  c.train.steps = 20
  c.train.log_every = 1
  c.train.eval_every = 10
  c.train.eval_batches = 2
  c.train.checkpoint_every = 5
  c.optim.warmup_steps = 2
  return c
