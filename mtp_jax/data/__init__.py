"""Data: tokenizers (bytes by default), the corpus kinds `data.corpus` names (corpus.py: tfds
builders of local corpora, the synthetic tasks, any prepared tfds dataset, token shards written
by `python -m mtp_jax.data.prepare`), the grain pipeline.

  from mtp_jax.data import make_iterator
  it = make_iterator(config, "train")   # {"tokens": int32[B, S], "segment_ids": int32[B, S]}

Names are imported on first use, so `python -m mtp_jax.data.tokenizers` does not import its own
module twice, and importing a tokenizer does not pay for tfds and grain.
"""

import importlib

_EXPORTS = {
    "ByteTokenizer": "tokenizers",
    "SentencePieceTokenizer": "tokenizers",
    "get_tokenizer": "tokenizers",
    "train_sentencepiece": "tokenizers",
    "load_source": "corpus",
    "record_text": "corpus",
    "make_dataset": "pipeline",
    "make_iterator": "pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
