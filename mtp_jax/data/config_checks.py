"""Validation of the `data.*` config fields (called by `validation.validate`): the corpus, the
tokenizer, the synthetic tasks' knobs and the real corpora's fields. Each error names the field
in one line; the datasets themselves are checked when the pipeline opens them, still before
anything is written. Imports nothing from mtp_jax, so config can import it."""

from __future__ import annotations

from collections.abc import Callable

import ml_collections

TOKENIZERS = ("byte", "sentencepiece", "hf")
CORPORA = ("python_code", "text_folder", "induction", "polynomial", "tfds", "array_record")
TASK_CORPORA = ("induction", "polynomial")  # synthetic, mtp_jax/data/tasks.py
POLY_OPS = "+-*o"  # polynomial task: add, negate, multiply, compose

Fail = Callable[[str, str], None]


def poly_max_len(n_ops: int, degree: int) -> int:
  """Characters of the longest polynomial-task example with n_ops operations: all binary, 2
  characters each ("* "), degree + 1 per operand, "=" and the answer."""
  return 2 * n_ops + (n_ops + 1) * (degree + 1) + degree


def _validate_task(d: ml_collections.ConfigDict, m: ml_collections.ConfigDict,
                   _fail: Fail) -> None:
  """The `data.*` fields of the synthetic tasks (checked when data.corpus names one)."""
  if d.tokenizer != "byte":
    _fail("data.tokenizer", f"the {d.corpus} task counts one token per character: it needs "
          f"'byte', got {d.tokenizer!r}")
  if d.task_seed < 0:
    _fail("data.task_seed", f"must be >= 0, got {d.task_seed}")
  for field in ("task_train_size", "task_eval_size"):
    if d[field] < 1:
      _fail(f"data.{field}", f"must be >= 1, got {d[field]}")
  if d.corpus == "induction":
    if not 1 <= d.induction_pairs <= 26:
      _fail("data.induction_pairs", f"must be in [1, 26] (one uppercase letter each), got "
            f"{d.induction_pairs}")
    if d.induction_repeats < 2:
      _fail("data.induction_repeats", f"must be >= 2 (a name must recur to be copied), got "
            f"{d.induction_repeats}")
    need = 2 * d.induction_pairs * d.induction_repeats
    if d.induction_len < need:
      _fail("data.induction_len", f"must be >= 2 * induction_pairs * induction_repeats "
            f"({need}), got {d.induction_len}")
    if d.induction_len >= d.seq_len:
      _fail("data.induction_len", f"must be < data.seq_len ({d.seq_len}) so an example and its "
            f"eos fit in a row, got {d.induction_len}")
    return
  if d.poly_modulus not in (2, 3, 5, 7):
    _fail("data.poly_modulus", f"must be a prime of one digit (2, 3, 5, 7), got {d.poly_modulus}")
  if d.poly_degree < 1:
    _fail("data.poly_degree", f"must be >= 1, got {d.poly_degree}")
  ops = str(d.poly_ops)
  if not ops or any(op not in POLY_OPS for op in ops) or len(set(ops)) != len(ops):
    _fail("data.poly_ops", f"must be distinct characters of {POLY_OPS!r}, got {ops!r}")
  if d.poly_train_ops < 1:
    _fail("data.poly_train_ops", f"must be >= 1, got {d.poly_train_ops}")
  if d.poly_ood_ops <= d.poly_train_ops:
    _fail("data.poly_ood_ops", f"must be > data.poly_train_ops ({d.poly_train_ops}), got "
          f"{d.poly_ood_ops}")
  longest = lambda n: poly_max_len(n, d.poly_degree)
  if longest(d.poly_train_ops) >= d.seq_len:
    _fail("data.seq_len", f"must be > {longest(d.poly_train_ops)} (the longest polynomial "
          f"example with {d.poly_train_ops} operations, and its eos), got {d.seq_len}")
  if longest(d.poly_ood_ops) > m.max_len:
    _fail("model.max_len", f"must be >= {longest(d.poly_ood_ops)} (the longest test_ood "
          f"example, {d.poly_ood_ops} operations), got {m.max_len}")


def _validate_corpus(d: ml_collections.ConfigDict, _fail: Fail) -> None:
  """The `data.*` fields of the real corpora (data/corpora.py); the datasets themselves are
  checked when the pipeline opens them, still before anything is written."""
  if d.corpus == "tfds":
    if not d.tfds_name:
      _fail("data.tfds_name", "must name a prepared tfds dataset ('name/config:version') when "
            "data.corpus is 'tfds'")
    for field in ("train_split", "val_split"):
      if not d[field]:
        _fail(f"data.{field}", "must be a tfds split string such as 'train' or 'train[:99%]'")
  if d.corpus == "array_record":
    if not d.files:
      _fail("data.files", "must be a glob of shards written by `python -m mtp_jax.data.prepare` "
            "when data.corpus is 'array_record'")
    if not d.val_files and not 1 <= d.val_percent <= 50:
      _fail("data.val_percent", "must be in [1, 50] (every round(100 / val_percent)-th record "
            f"is held out for validation) when data.val_files is empty, got {d.val_percent}")


def validate_data(c: ml_collections.ConfigDict, _fail: Fail, _choice) -> None:
  """Checks `c.data` (and the model fields it depends on); `_fail(field, msg)` raises."""
  m, d = c.model, c.data
  _choice(c, "data.corpus", CORPORA)
  _choice(c, "data.tokenizer", TOKENIZERS)
  if d.corpus in TASK_CORPORA:
    _validate_task(d, m, _fail)
  _validate_corpus(d, _fail)
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
  if d.corpus == "text_folder" and not d.folder:
    _fail("data.folder", "must name a folder when data.corpus is 'text_folder'")
  if not 0 <= d.val_percent < 100:
    _fail("data.val_percent", f"must be in [0, 100), got {d.val_percent}")
