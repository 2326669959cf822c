"""The config: `base` declares every field with its default and allowed values (JAX-free, what
this package exports); `validation` checks a config and expands the head kinds' presets, once,
at an entry point (`from mtp_jax.config import validation; validation.resolve(config)`)."""

from mtp_jax.config.base import (ALLOWED, DISTRIBUTED_MODES, DRAFT_OBJECTIVES, FLOAT_RANGES,
                                 SCHEDULES, TOKENIZERS, TRAINABLE, base_config, load_file,
                                 load_json, save_json)
from mtp_jax.loss_fields import HEAD_WEIGHTS, parse_head_weights, parse_lambda_schedule
from mtp_jax.model_args import DTYPES

__all__ = ["ALLOWED", "DISTRIBUTED_MODES", "DRAFT_OBJECTIVES", "DTYPES", "FLOAT_RANGES",
           "HEAD_WEIGHTS", "SCHEDULES", "TOKENIZERS", "TRAINABLE", "base_config", "load_file",
           "load_json", "parse_head_weights", "parse_lambda_schedule", "save_json"]
