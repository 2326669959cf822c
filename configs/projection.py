"""Light projection heads (seed 000's sketch): RMSNorm -> Linear(d, 2d) -> SiLU -> Linear(2d, d)
plus a residual per extra head, on the full 6-block trunk."""

from mtp_jax.config import base_config


def get_config():
  c = base_config()
  c.model.n_future = 4
  c.model.heads.kind = "projection"
  return c
