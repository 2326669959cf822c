"""Validation of the `data.*` config fields (called by `validation.validate`): the corpus kind
(whose own fields its `corpus.Corpus.check` validates), the tokenizer, the sequence length. Each
error names the field in one line; the datasets themselves are checked when the pipeline opens
them, still before anything is written. JAX- and tfds-free."""

from __future__ import annotations

from collections.abc import Callable

import ml_collections

from mtp_jax.data import corpus

TOKENIZERS = ("byte", "sentencepiece", "hf")

Fail = Callable[[str, str], None]


def validate_data(c: ml_collections.ConfigDict, _fail: Fail, _choice) -> None:
  """Checks `c.data` (and the model fields it depends on); `_fail(field, msg)` raises."""
  m, d = c.model, c.data
  _choice(c, "data.corpus", tuple(corpus.KINDS))
  _choice(c, "data.tokenizer", TOKENIZERS)
  corpus.get(d).check(d, m, _fail)  # the fields of the kind data.corpus names
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
