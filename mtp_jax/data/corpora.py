"""Real corpora: any prepared tfds dataset, and token shards written by `prepare`.

  tfds          `data.tfds_name` ("name/config:version") read from `data.tfds_data_dir` through
                tfds's ArrayRecord data source: the dataset's files only (no dataset code, no
                TensorFlow), and nothing is downloaded. `data.text_key` names the text feature
                ("text", or nested: "document/body" or "document.body"); `data.train_split`
                and `data.val_split` are tfds split strings ("train[:99%]").
  array_record  `data.files`, a glob of shards written by `python -m mtp_jax.data.prepare`: one
                record per document, its token ids (no bos/eos: the pipeline adds them). The
                metadata.json beside the shards names the tokenizer; a mismatch with
                `data.tokenizer` is an error at startup. Validation is `data.val_files` (another
                glob, e.g. a prepare of the source's validation split) or, when that is empty,
                records held out by index: global record i (shards in sorted-path order) is
                validation when i mod round(100 / data.val_percent) == 0, so the split needs no
                pass over the data and is the same on every host.

Every error here is one line naming the field, raised when the iterator is made: before the
training loop writes anything.
"""

from __future__ import annotations

import glob as glob_lib
import hashlib
import json
import os

import numpy as np

METADATA = "metadata.json"
FORMAT = "mtp_jax.tokens/1"
SHARD_PATTERN = "tokens-{:05d}-of-{:05d}.array_record"
# Beside each shard, its records' token counts (uint32): what lets a process find the packed
# rows it reads without reading the others (rows.py).
LENGTHS_SUFFIX = ".lengths.npy"
# group_size 1: every record its own chunk, so random access decompresses only what it reads.
WRITER_OPTIONS = "group_size:1"


# tfds.


def split_key(key: str) -> list[str]:
  """'document/body' or 'document.body' -> ['document', 'body']."""
  return [p for p in key.replace(".", "/").split("/") if p]


def record_field(record, key: str):
  """The value at a nested key of a decoded record (str or bytes text); KeyError if absent."""
  value = record
  for part in split_key(key):
    value = value[part]
  return value


def default_tfds_dir() -> str:
  import tensorflow_datasets as tfds
  return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser(
      str(tfds.core.constants.DATA_DIR))


def tfds_builder(name: str, data_dir: str, *, field: str = "config.data.tfds_name"):
  """The read-only builder of a prepared ArrayRecord dataset, from its files alone."""
  import tensorflow_datasets as tfds
  from tensorflow_datasets.core import read_only_builder
  if not name:
    raise ValueError(f"{field}: must name a prepared tfds dataset ('name/config:version')")
  where = os.path.expanduser(data_dir) if data_dir else default_tfds_dir()
  try:
    builder = read_only_builder.builder_from_files(name, data_dir=where)
  except Exception:  # (DatasetNotFoundError or a malformed name)
    base = name.split("/")[0].split(":")[0]
    if base in tfds.list_builders(with_community_datasets=False):
      raise ValueError(f"{field}: {name!r} is not prepared in {where}; prepare it once (this "
                       f"downloads) with: tfds build {name} --data_dir={where} "
                       "--file_format=array_record") from None
    raise ValueError(f"{field}: no dataset {name!r} in the tfds catalog or prepared in "
                     f"{where}") from None
  fmt = builder.info.file_format
  if fmt is None or fmt.value != "array_record":
    raise ValueError(f"{field}: {name!r} in {where} is prepared as {fmt.value if fmt else '?'}, "
                     "grain reads array_record; convert it with: tfds convert_format "
                     f"--dataset_version_dir={builder.data_dir} --out_file_format=array_record")
  return builder


def check_text_key(builder, key: str, *, field: str = "config.data.text_key") -> None:
  """Raises the one-line error when `key` is not a text feature of the builder's records."""
  import tensorflow_datasets as tfds
  feature = builder.info.features
  for part in split_key(key):
    if not isinstance(feature, tfds.features.FeaturesDict) or part not in feature:
      keys = list(feature.keys()) if isinstance(feature, tfds.features.FeaturesDict) else []
      raise ValueError(f"{field}: {builder.info.full_name} has no feature {key!r}; features: "
                       + (", ".join(map(repr, keys)) or "none at that level"))
    feature = feature[part]
  if not isinstance(feature, tfds.features.Text) and not (
      isinstance(feature, tfds.features.Tensor) and feature.shape == ()
      and feature.np_dtype == np.object_):
    raise ValueError(f"{field}: {key!r} of {builder.info.full_name} is a "
                     f"{type(feature).__name__}, not text")


def tfds_split_source(builder, split: str, *, field: str):
  """Random-access records of a tfds split string ("train", "train[:99%]")."""
  try:
    return builder.as_data_source(split=split)
  except Exception as e:  # (unknown split or bad slice syntax)
    raise ValueError(f"{field}: {split!r} is not a split of {builder.info.full_name} (splits: "
                     f"{', '.join(map(repr, builder.info.splits))}; slices such as "
                     f"'train[:99%]' allowed): {str(e).splitlines()[0] if str(e) else ''}"
                     ) from None


def tfds_source(data_config, split: str):
  """The records of `split` ("train" or "validation") of the tfds corpus `data.*` names."""
  d = data_config
  builder = tfds_builder(d.tfds_name, d.tfds_data_dir)
  check_text_key(builder, d.text_key)
  field = "train_split" if split == "train" else "val_split"
  return tfds_split_source(builder, d[field], field=f"config.data.{field}")


# Token shards (data.corpus = "array_record").


def file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def tokenizer_record(kind: str, tokenizer, path: str = "") -> dict:
  """What metadata.json says about the tokenizer (and what a config's tokenizer must match)."""
  return {"kind": kind, "path": path, "sha256": file_sha256(path) if path else "",
          "vocab_size": int(tokenizer.vocab_size), "pad_id": int(tokenizer.pad_id),
          "bos_id": int(tokenizer.bos_id), "eos_id": int(tokenizer.eos_id)}


def shard_files(pattern: str, field: str) -> list[str]:
  """The files matching a glob, sorted (the order defines the global record index)."""
  if not pattern:
    raise ValueError(f"{field}: must be a glob of shards written by `python -m "
                     "mtp_jax.data.prepare` when data.corpus is 'array_record'")
  files = sorted(f for f in glob_lib.glob(os.path.expanduser(pattern), recursive=True)
                 if os.path.isfile(f) and not f.endswith((".json", LENGTHS_SUFFIX)))
  if not files:
    raise ValueError(f"{field}: no file matches {pattern!r}")
  return files


def load_metadata(files: list[str], field: str) -> dict:
  """The metadata the shards share, checked: every file listed, at its full size."""
  by_dir: dict[str, dict] = {}
  for path in files:
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in by_dir:
      meta_path = os.path.join(folder, METADATA)
      try:
        with open(meta_path) as f:
          meta = json.load(f)
      except (OSError, ValueError):
        raise ValueError(f"{field}: {meta_path} is missing or unreadable: {path} was not "
                         "written by `python -m mtp_jax.data.prepare` (or prepare did not "
                         "finish)") from None
      if meta.get("format") != FORMAT:
        raise ValueError(f"{field}: {meta_path} has format {meta.get('format')!r}, expected "
                         f"{FORMAT!r}")
      by_dir[folder] = meta
    meta = by_dir[folder]
    shard = {s["file"]: s for s in meta["shards"]}.get(os.path.basename(path))
    if shard is None:
      raise ValueError(f"{field}: {path} is not one of the shards listed in {folder}/{METADATA}")
    size = os.path.getsize(path)
    if size != shard["bytes"]:
      raise ValueError(f"{field}: {path} has {size} bytes, its metadata says {shard['bytes']}: "
                       "the shard is truncated or was rewritten; run prepare again")
  metas = list(by_dir.values())
  for other, folder in zip(metas[1:], list(by_dir)[1:]):
    if (other["tokenizer"], other["dtype"]) != (metas[0]["tokenizer"], metas[0]["dtype"]):
      raise ValueError(f"{field}: the shards in {folder} and {list(by_dir)[0]} were written "
                       "with different tokenizers")
  return metas[0]


def check_tokenizer(meta: dict, data_config, tokenizer, folder: str) -> None:
  """One line when the config's tokenizer is not the one the shards were written with."""
  want = meta["tokenizer"]
  have = tokenizer_record(data_config.tokenizer, tokenizer,
                          getattr(tokenizer, "path", ""))
  keys = ("kind", "sha256", "vocab_size", "pad_id", "bos_id", "eos_id")
  if any(want[k] != have[k] for k in keys):
    desc = lambda t: (f"{t['kind']}" + (f" {t['path']} (sha256 {t['sha256'][:12]})"
                                        if t["kind"] != "byte" else "")
                      + f", vocab {t['vocab_size']}")
    raise ValueError(f"config.data.tokenizer: the shards in {folder} were written with "
                     f"{desc(want)}, the config has {desc(have)}; set data.tokenizer/"
                     "data.spm_path to match, or prepare the corpus again")


def write_lengths(shard_path: str, lengths) -> None:
  """The record lengths of a shard, written atomically beside it."""
  tmp = shard_path + LENGTHS_SUFFIX + ".tmp"
  with open(tmp, "wb") as f:
    np.save(f, np.asarray(lengths, np.uint32))
  os.replace(tmp, shard_path + LENGTHS_SUFFIX)


def record_lengths(files: list[str]) -> np.ndarray | None:
  """The token count of every record of `files` in order, from the lengths files `prepare`
  writes beside the shards; None when one is missing or does not match its shard's metadata
  (shards written before those files existed)."""
  out = []
  for path in files:
    try:
      lengths = np.load(path + LENGTHS_SUFFIX)
      with open(os.path.join(os.path.dirname(os.path.abspath(path)), METADATA)) as f:
        shard = {s["file"]: s for s in json.load(f)["shards"]}[os.path.basename(path)]
    except (OSError, ValueError, KeyError):
      return None
    if len(lengths) != shard["records"] or int(lengths.sum(dtype=np.int64)) != shard["tokens"]:
      return None
    out.append(lengths.astype(np.int64))
  return np.concatenate(out)


class HeldOut:
  """Every k-th record of a source (k = round(100 / percent)) is validation, the rest train.

  Closed form, no index array: a corpus of a billion records costs nothing to split, and a
  corpus of five records still has both splits.
  """

  def __init__(self, source, percent: float, validation: bool):
    self._source = source
    self._k = k = max(2, round(100 / percent))
    self._validation = validation
    n_val = -(-len(source) // k)
    self._len = n_val if validation else len(source) - n_val

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, j: int):
    j = int(j)
    if not 0 <= j < self._len:
      raise IndexError(j)
    k = self._k
    return self._source[j * k if self._validation else j + j // (k - 1) + 1]


def token_source(data_config, split: str, tokenizer):
  """(random-access source of token records, metadata) of `split` of the array_record corpus."""
  import grain
  d = data_config
  field = "config.data.val_files" if split != "train" and d.val_files else "config.data.files"
  files = shard_files(d.val_files if field.endswith("val_files") else d.files, field)
  meta = load_metadata(files, field)
  check_tokenizer(meta, d, tokenizer, os.path.dirname(os.path.abspath(files[0])))
  try:
    source = grain.sources.ArrayRecordDataSource(files)
    len(source)
  except Exception as e:  # (a corrupt footer or index)
    raise ValueError(f"{field}: cannot read the shards: {str(e).splitlines()[0]}") from None
  if not d.val_files:
    source = HeldOut(source, d.val_percent, validation=split != "train")
  if not len(source):
    raise ValueError(f"{field}: the {split} split is empty ({len(files)} shard(s); "
                     f"data.val_percent {d.val_percent}, data.val_files {d.val_files!r})")
  return source, meta


class DecodeTokens:
  """A token record (bytes) -> int32 ids with eos (and bos) added; picklable for grain workers."""

  def __init__(self, dtype: str, bos_id: int, eos_id: int, add_bos: bool):
    self.dtype = np.dtype(dtype)
    self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos

  def __call__(self, record: bytes) -> np.ndarray:
    ids_T = np.frombuffer(record, self.dtype)
    out_T = np.empty(len(ids_T) + 1 + self.add_bos, np.int32)
    if self.add_bos:
      out_T[0] = self.bos_id
    out_T[self.add_bos:-1] = ids_T
    out_T[-1] = self.eos_id
    return out_T
