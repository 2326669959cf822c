"""The config's data section: every data.* field with its default, declared by the package that
reads them (as model_args declares config.model), so the data package's own entry points
(`python -m mtp_jax.data.tokenizers`) take their defaults from here, below the config, which
puts this section in `base_config()` and checks it. JAX-free."""

from __future__ import annotations

import os

import ml_collections

TOKENIZERS = ("byte", "sentencepiece", "hf")  # data.tokenizer


def data_defaults() -> ml_collections.ConfigDict:
  """The data section of `mtp_jax.config.base_config()`."""
  d = ml_collections.ConfigDict()
  d.corpus = "python_code"
  d.dir = os.path.join(os.path.expanduser("~"), ".cache", "mtp_jax", "datasets")
  d.folder = ""  # text_folder corpus: root folder
  d.glob = "**/*.py"  # text_folder corpus: files to take
  d.val_percent = 5  # validation split: files whose path hash falls below this percent
  d.tokenizer = "byte"
  d.spm_path = ""  # sentencepiece model file when tokenizer == "sentencepiece"
  d.hf_tokenizer = ""  # tokenizer.json (or its folder) when tokenizer == "hf"
  d.seq_len = 256
  d.shuffle_seed = 0
  d.worker_count = 0
  # True: a document that does not fit in the rest of a row starts the next one (padding).
  d.whole_docs = False
  # Synthetic tasks (Gloeckle et al. 2024 §4; data/tasks.py), generated from task_seed.
  d.task_seed = 0
  d.task_train_size = 50_000  # train examples
  d.task_eval_size = 1_000  # examples of each other split
  d.induction_len = 63  # letters per example (+ eos: 64 tokens)
  d.induction_pairs = 4  # distinct names per example
  d.induction_repeats = 3  # occurrences of each name
  d.poly_modulus = 7  # the ring F_p[X]/(X^d): p ...
  d.poly_degree = 5  # ... and d (a polynomial is d coefficients)
  d.poly_ops = "+-*"  # operations drawn, from POLY_OPS; the paper adds "o"
  d.poly_train_ops = 5  # train and validation: 1..poly_train_ops operations
  d.poly_ood_ops = 8  # test_ood: poly_train_ops+1..poly_ood_ops
  # Real corpora (data/corpora.py; README "Real corpora"). tfds: a dataset prepared as
  # array_record (`tfds build NAME --file_format=array_record`), read without TensorFlow.
  d.tfds_name = ""  # "name/config:version", e.g. "c4/en:3.0.1"
  d.tfds_data_dir = ""  # "" = TFDS_DATA_DIR or ~/tensorflow_datasets
  d.text_key = "text"  # the text feature; nested: "document/body" or "document.body"
  d.train_split = "train"  # tfds split strings: "train[:99%]"
  d.val_split = "validation"  # e.g. "train[99%:]" for a dataset without one
  # array_record: token shards written by `python -m mtp_jax.data.prepare`.
  d.files = ""  # glob of the shards, e.g. "~/corpora/code/tokens-*.array_record"
  d.val_files = ""  # "" = hold out every round(100 / val_percent)-th record
  return d
