"""Checking a config (`validate`: checks, never changes it) and the explicit step that expands the
head kinds' presets (`expand_presets`); `resolve` does both, once, at an entry point (train,
generate, evaluate, convert, a workdir's loading, a benchmark's config). Nothing below the entry
points validates again: `model.build_model` and the steps take the resolved config.

The allowed values and float ranges are declared beside their fields (`config.base`, and
`model_args.ModelArgs` for config.model); registries answer for their own kinds: a head kind for
its config.model.heads fields (`heads.HeadKind.validate_fields`), a corpus kind for its data
fields (`data.corpus.Corpus.check`). This module sits above both registries in the layer order
(tests/test_layout.py), never below: nothing under mtp_jax.model imports it.
"""

from __future__ import annotations

import math

import ml_collections

from mtp_jax import heads
from mtp_jax.config.base import ALLOWED, FLOAT_RANGES, base_config
from mtp_jax.loss_fields import HEAD_WEIGHTS, parse_head_weights, parse_lambda_schedule
from mtp_jax.data import corpus


def expand_presets(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Sets the fields each preset of config.model.heads names, in place; returns c."""
  for field, value in heads.preset_values(c.model.heads).items():
    c.model.heads[field] = value
  return c


def resolve(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """validate(c), then expand_presets(c): the config an entry point runs (and saves)."""
  return expand_presets(validate(c))


def _fail(field: str, msg: str):
  raise ValueError(f"config.{field}: {msg}")


def _get(c, field: str):
  for part in field.split("."):
    c = getattr(c, part)
  return c


def _choice(c, field: str, allowed):
  value = _get(c, field)
  if value not in allowed:
    _fail(field, f"got {value!r}, allowed: {', '.join(map(repr, allowed))}")


def _at_least(c, fields: str, low: int, words: str = "") -> None:
  """Each of the space-separated dotted `fields` is >= low (`words`: what the edge means)."""
  for field in fields.split():
    value = _get(c, field)
    if int(value) < low:
      _fail(field, f"must be >= {low}{words}, got {value}")


def _mkl_unavailable() -> str | None:
  """Why model.cpu_matmul = mkl cannot run here, else None. Imports the CPU backend's MKL
  handler, so only a config that asks for it does."""
  from mtp_jax.backends.cpu import gemm
  return gemm.unavailable_reason()


def _declared(c: ml_collections.ConfigDict) -> None:
  """What base.py and ModelArgs declare beside the fields: floats finite and in range, choices
  among their allowed values; then the registries' kinds."""
  for field, (words, in_range) in FLOAT_RANGES.items():
    value = _get(c, field)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and in_range(value)):
      _fail(field, f"must be a finite number {words}, got {value!r}")
  for field, allowed in ALLOWED.items():
    _choice(c, field, allowed)
  _choice(c, "model.heads.kind", tuple(heads.KINDS))
  _choice(c, "data.corpus", tuple(corpus.KINDS))


def _model(c: ml_collections.ConfigDict) -> None:
  m = c.model
  _at_least(c, "model.vocab_size model.vocab_multiple model.d_model model.n_layers model.n_heads "
            "model.n_kv_heads model.d_ff model.max_len model.n_future", 1)
  if m.cpu_matmul == "mkl" and (why := _mkl_unavailable()):
    _fail("model.cpu_matmul", f"mkl is not available here: {why} (auto or xla are)")
  if m.scan_unroll < 0:
    _fail("model.scan_unroll", f"must be 0 (auto) or >= 1 layers per loop iteration, got "
          f"{m.scan_unroll}")
  # Heads: every kind's own fields (whichever kind is chosen, so a typo in a saved config
  # fails), then the chosen kind's own checks.
  defaults = base_config().model.heads
  for kind in heads.KINDS.values():
    kind.validate_fields(m.heads, defaults, _fail)
  heads.KINDS[m.heads.kind].validate_config(m, _fail)
  # The model-family fields (head_dim, RoPE scaling, sliding window: layers.Attention).
  if m.head_dim < 0 or m.head_dim % 2:
    _fail("model.head_dim", f"must be 0 (d_model // n_heads) or an even size, got {m.head_dim}")
  if not m.head_dim and m.d_model % m.n_heads:
    _fail("model.n_heads", f"must divide model.d_model ({m.d_model}), got {m.n_heads}")
  if not m.head_dim and (m.d_model // m.n_heads) % 2:
    _fail("model.n_heads", f"head size d_model/n_heads = {m.d_model // m.n_heads} must be even "
          "for RoPE")
  _at_least(c, "model.rope_original_max_len", 1)
  if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
    _fail("model.rope_high_freq_factor", f"must exceed model.rope_low_freq_factor "
          f"({m.rope_low_freq_factor}), got {m.rope_high_freq_factor}")
  _at_least(c, "model.sliding_window", 0, " (0: no window)")
  if m.n_heads % m.n_kv_heads:
    _fail("model.n_kv_heads", f"must divide model.n_heads ({m.n_heads}), got {m.n_kv_heads}")


def _data(c: ml_collections.ConfigDict) -> None:
  """data.*: the corpus kind's own fields (`corpus.Corpus.check`), the tokenizer, the sequence
  length. The datasets themselves are checked when the pipeline opens them, still before
  anything is written."""
  m, d = c.model, c.data
  corpus.get(d).check(d, m, _fail)
  if d.seq_len <= m.n_future:
    _fail("data.seq_len", f"must be > model.n_future ({m.n_future}) so every head has a "
          f"target, got {d.seq_len}")
  if d.seq_len > m.max_len:
    _fail("data.seq_len", f"must be <= model.max_len ({m.max_len}), got {d.seq_len}")
  if d.tokenizer == "sentencepiece" and not d.spm_path:
    _fail("data.spm_path", "must name a SentencePiece model file when data.tokenizer is "
          "'sentencepiece'")
  if d.tokenizer == "hf" and not d.hf_tokenizer:
    _fail("data.hf_tokenizer", "must name a tokenizer.json file (or its folder) when "
          "data.tokenizer is 'hf'")
  if not 0 <= d.val_percent < 100:
    _fail("data.val_percent", f"must be in [0, 100), got {d.val_percent}")


def _loss(c: ml_collections.ConfigDict) -> None:
  lo, n = c.loss, c.model.n_future
  if lo.token_chunks < 1 or c.data.seq_len % lo.token_chunks:
    _fail("loss.token_chunks", f"must be >= 1 and divide data.seq_len ({c.data.seq_len}), got "
          f"{lo.token_chunks}")
  weights = parse_head_weights(lo.head_weights)
  if isinstance(weights, str):
    _choice(c, "loss.head_weights", HEAD_WEIGHTS + ("or comma-separated numbers",))
  else:
    if len(weights) != n:
      _fail("loss.head_weights", f"a list needs one weight per head (model.n_future = {n}), "
            f"got {len(weights)}")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
      _fail("loss.head_weights", f"weights must be finite numbers >= 0, got {weights}")
  try:
    schedule = parse_lambda_schedule(lo.mtp_lambda_schedule)[0]
  except ValueError as e:
    _fail("loss.mtp_lambda_schedule", str(e))
  if schedule != "constant" and lo.head_weights != "deepseek":
    _fail("loss.mtp_lambda_schedule", f"schedules loss.mtp_lambda, which only "
          f"loss.head_weights = 'deepseek' reads, got head_weights {lo.head_weights!r}")
  for field, off in (("head_curriculum", 0), ("draft_objective", "ce")):
    if lo[field] != off and n < 2:
      _fail(f"loss.{field}", f"acts on heads 2..n and model.n_future is {n}: set "
            f"model.n_future >= 2 or loss.{field}={off!r}")


def _train(c: ml_collections.ConfigDict) -> None:
  t, o, n = c.train, c.optim, c.model.n_future
  if o.trainable == "heads" and n < 2:
    _fail("optim.trainable", f"'heads' trains heads 2..n and model.n_future is {n}: set "
          "model.n_future >= 2 or optim.trainable='all'")
  _at_least(c, "train.batch_size train.grad_accum train.steps train.log_every train.eval_every "
            "train.checkpoint_every train.keep_checkpoints train.eval_batches", 1)
  _at_least(c, "train.stop_at", 0, " (0 = run to train.steps)")
  if t.batch_size % t.grad_accum:
    _fail("train.grad_accum", f"must divide train.batch_size ({t.batch_size}), got "
          f"{t.grad_accum}")
  rows = t.batch_size // t.grad_accum
  if t.batch_slices < 0 or (t.batch_slices and rows % t.batch_slices):
    _fail("train.batch_slices", f"must be 0 (auto) or divide the {rows} rows of a micro-batch "
          f"(train.batch_size / train.grad_accum), got {t.batch_slices}")
  _at_least(c, "optim.warmup_steps", 0)
  _at_least(c, "optim.max_consecutive_nonfinite", 1)


def _mesh(c: ml_collections.ConfigDict) -> None:
  me = c.mesh
  if me.num_processes < 0:
    _fail("mesh.num_processes", f"must be >= 1 (0: from JAX_NUM_PROCESSES or the launcher), "
          f"got {me.num_processes}")
  if me.process_id < -1 or (me.num_processes and me.process_id >= me.num_processes):
    bound = (f"in [0, mesh.num_processes = {me.num_processes})" if me.num_processes
             else ">= 0")
    _fail("mesh.process_id", f"must be {bound} (-1: from JAX_PROCESS_ID or the launcher), got "
          f"{me.process_id}")
  if me.distributed_timeout_s < 1:
    _fail("mesh.distributed_timeout_s", f"must be >= 1 second, got {me.distributed_timeout_s}")
  for axis in ("data", "fsdp", "tensor"):
    v = getattr(me, axis)
    if v != -1 and v < 1:
      _fail(f"mesh.{axis}", f"must be -1 (fill) or >= 1, got {v}")


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks every field the code relies on; raises ValueError naming the field. Returns c."""
  _declared(c)
  _model(c)
  _data(c)
  _loss(c)
  _train(c)
  _mesh(c)
  return c
