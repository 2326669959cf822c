"""Validation of a config (`validate`: checks, never changes it) and the explicit step that
expands the head kinds' presets (`expand_presets`; `resolve` does both, what the entry points
call). Above the head-kind registry, which it asks about `model.heads.*`; config.py itself stays
JAX-free.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections

from mtp_jax import attention
from mtp_jax import family_checks
from mtp_jax import heads
from mtp_jax.config import DTYPES, HEAD_WEIGHTS, base_config, parse_head_weights
from mtp_jax.data import config_checks as data_checks
from mtp_jax.sharding import DISTRIBUTED_MODES

REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
SCHEDULES = ("cosine", "linear", "constant")
TRAINABLE = ("all", "heads")  # optim.trainable: "heads" trains heads 2..n only (optimizer.py)
# Every float field: (the allowed range in words, the test). validate() checks each value is a
# finite number in range (nan fails no `<` test); tests/test_config.py fails for a float field
# missing here.
FLOAT_RANGES = {
    "model.rope_theta": ("> 0", lambda x: x > 0),
    "model.norm_eps": ("> 0", lambda x: x > 0),
    "model.rope_factor": (">= 1", lambda x: x >= 1),
    "model.rope_low_freq_factor": ("> 0", lambda x: x > 0),
    "model.rope_high_freq_factor": ("> 0", lambda x: x > 0),
    "model.rope_beta_fast": ("> 0", lambda x: x > 0),
    "model.rope_beta_slow": ("> 0", lambda x: x > 0),
    "model.rope_attention_factor": (">= 0 (0: from rope_factor)", lambda x: x >= 0),
    "loss.geometric_decay": ("in (0, 1]", lambda x: 0 < x <= 1),
    "loss.mtp_lambda": (">= 0", lambda x: x >= 0),
    "loss.z_loss": (">= 0", lambda x: x >= 0),
    "optim.lr": ("> 0", lambda x: x > 0),
    "optim.min_lr_ratio": ("in [0, 1]", lambda x: 0 <= x <= 1),
    "optim.b1": ("in [0, 1)", lambda x: 0 <= x < 1),
    "optim.b2": ("in [0, 1)", lambda x: 0 <= x < 1),
    "optim.eps": ("> 0", lambda x: x > 0),
    "optim.weight_decay": (">= 0", lambda x: x >= 0),
    "optim.grad_clip": (">= 0 (0: no clipping)", lambda x: x >= 0),
}


def preset_values(h: ml_collections.ConfigDict) -> dict[str, Any]:
  """{field: value} that the chosen presets of config.model.heads `h` set (every kind's
  preset field, whichever kind is chosen, as validate checks them)."""
  out = {}
  for kind in heads.KINDS.values():
    if kind.preset_field:
      out.update(kind.presets.get(h[kind.preset_field], {}))
  return out


def expand_presets(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Sets the fields each preset of config.model.heads names, in place; returns c."""
  for field, value in preset_values(c.model.heads).items():
    c.model.heads[field] = value
  return c


def resolve(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """validate(c), then expand_presets(c): the config an entry point runs (and saves)."""
  return expand_presets(validate(c))


def _fail(field: str, msg: str):
  raise ValueError(f"config.{field}: {msg}")


def _mkl_unavailable() -> str | None:
  """Why model.cpu_matmul = mkl cannot run here, else None. Imports the CPU backend's MKL
  handler, so only a config that asks for it does."""
  from mtp_jax.backends.cpu import gemm
  return gemm.unavailable_reason()


def _get(c, field: str):
  for part in field.split("."):
    c = getattr(c, part)
  return c


def _choice(c, field: str, allowed):
  value = _get(c, field)
  if value not in allowed:
    _fail(field, f"got {value!r}, allowed: {', '.join(map(repr, allowed))}")


def _validate_floats(c: ml_collections.ConfigDict) -> None:
  for field, (words, in_range) in FLOAT_RANGES.items():
    value = _get(c, field)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and in_range(value)):
      _fail(field, f"must be a finite number {words}, got {value!r}")


def _validate_heads(c: ml_collections.ConfigDict) -> None:
  """model.heads: a registered kind; every kind's own fields (whichever kind is chosen, so a
  typo in a saved config fails); then the chosen kind's own checks."""
  _choice(c, "model.heads.kind", tuple(heads.KINDS))
  for kind in heads.KINDS.values():
    kind.validate_fields(c.model.heads, base_config().model.heads, _fail)
  heads.KINDS[c.model.heads.kind].validate_config(c.model, _fail)


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks every field the code relies on; raises ValueError naming the field. Returns c."""
  m = c.model
  _validate_floats(c)
  _choice(c, "model.remat_policy", REMAT_POLICIES)
  _choice(c, "model.dtype", DTYPES)
  _choice(c, "model.attention_impl", attention.IMPLS)
  for field in ("vocab_size", "vocab_multiple", "d_model", "n_layers", "n_heads", "n_kv_heads",
                "d_ff", "max_len"):
    if int(getattr(m, field)) < 1:
      _fail(f"model.{field}", f"must be >= 1, got {getattr(m, field)}")
  if m.n_future < 1:
    _fail("model.n_future", f"must be >= 1, got {m.n_future}")
  if m.fuse_projections not in ("auto", "on", "off"):
    _fail("model.fuse_projections", f"must be auto, on or off, got {m.fuse_projections!r}")
  if m.cpu_matmul not in ("auto", "xla", "mkl"):
    _fail("model.cpu_matmul", f"must be auto, xla or mkl, got {m.cpu_matmul!r}")
  if m.cpu_matmul == "mkl" and (why := _mkl_unavailable()):
    _fail("model.cpu_matmul", f"mkl is not available here: {why} "
          f"(auto or xla are)")
  if m.scan_unroll < 0:
    _fail("model.scan_unroll", f"must be 0 (auto) or >= 1 layers per loop iteration, got "
          f"{m.scan_unroll}")
  _validate_heads(c)
  family_checks.validate_family(c, _fail, _choice)
  if m.n_heads % m.n_kv_heads:
    _fail("model.n_kv_heads", f"must divide model.n_heads ({m.n_heads}), got {m.n_kv_heads}")

  data_checks.validate_data(c, _fail, _choice)
  d = c.data

  lo = c.loss
  if lo.token_chunks < 1 or d.seq_len % lo.token_chunks:
    _fail("loss.token_chunks", f"must be >= 1 and divide data.seq_len ({d.seq_len}), got "
          f"{lo.token_chunks}")
  weights = parse_head_weights(lo.head_weights)
  if isinstance(weights, str):
    _choice(c, "loss.head_weights", HEAD_WEIGHTS + ("or comma-separated numbers",))
  else:
    if len(weights) != m.n_future:
      _fail("loss.head_weights", f"a list needs one weight per head (model.n_future = "
            f"{m.n_future}), got {len(weights)}")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
      _fail("loss.head_weights", f"weights must be finite numbers >= 0, got {weights}")

  t, o = c.train, c.optim
  _choice(c, "optim.schedule", SCHEDULES)
  _choice(c, "optim.trainable", TRAINABLE)
  if o.trainable == "heads" and m.n_future < 2:
    _fail("optim.trainable", f"'heads' trains heads 2..n and model.n_future is {m.n_future}: "
          "set model.n_future >= 2 or optim.trainable='all'")
  for field in ("batch_size", "grad_accum", "steps", "log_every", "eval_every",
                "checkpoint_every", "keep_checkpoints", "eval_batches"):
    if int(getattr(t, field)) < 1:
      _fail(f"train.{field}", f"must be >= 1, got {getattr(t, field)}")
  if t.stop_at < 0:
    _fail("train.stop_at", f"must be >= 0 (0 = run to train.steps), got {t.stop_at}")
  if t.batch_size % t.grad_accum:
    _fail("train.grad_accum", f"must divide train.batch_size ({t.batch_size}), got "
          f"{t.grad_accum}")
  rows = t.batch_size // t.grad_accum
  if t.batch_slices < 0 or (t.batch_slices and rows % t.batch_slices):
    _fail("train.batch_slices", f"must be 0 (auto) or divide the {rows} rows of a micro-batch "
          f"(train.batch_size / train.grad_accum), got {t.batch_slices}")
  if o.warmup_steps < 0:
    _fail("optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
  if o.max_consecutive_nonfinite < 1:
    _fail("optim.max_consecutive_nonfinite", f"must be >= 1, got {o.max_consecutive_nonfinite}")
  _choice(c, "mesh.distributed", DISTRIBUTED_MODES)
  if c.mesh.num_processes < 0:
    _fail("mesh.num_processes", f"must be >= 1 (0: from JAX_NUM_PROCESSES or the launcher), "
          f"got {c.mesh.num_processes}")
  if c.mesh.process_id < -1 or (c.mesh.num_processes and
                                c.mesh.process_id >= c.mesh.num_processes):
    bound = (f"in [0, mesh.num_processes = {c.mesh.num_processes})" if c.mesh.num_processes
             else ">= 0")
    _fail("mesh.process_id", f"must be {bound} (-1: from JAX_PROCESS_ID or the launcher), got "
          f"{c.mesh.process_id}")
  if c.mesh.distributed_timeout_s < 1:
    _fail("mesh.distributed_timeout_s", f"must be >= 1 second, got "
          f"{c.mesh.distributed_timeout_s}")
  for axis in ("data", "fsdp", "tensor"):
    v = getattr(c.mesh, axis)
    if v != -1 and v < 1:
      _fail(f"mesh.{axis}", f"must be -1 (fill) or >= 1, got {v}")
  return c
