"""Next-token baseline at matched parameters: configs/default.py with n_future = 1."""

from mtp_jax.config import base_config


def get_config():
  c = base_config()
  c.model.n_future = 1
  return c
