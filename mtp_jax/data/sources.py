"""The document sources `python -m mtp_jax.data.prepare` reads: a folder of files, a JSONL file,
a prepared tfds dataset, or a Hugging Face dataset from the local cache (the `hf` extra) or a
folder written by `save_to_disk`. Each is an indexable sequence of document texts (None for a
document that cannot be read), so worker processes can tokenize ranges of it.
"""

from __future__ import annotations

import json
import os

import numpy as np

from mtp_jax.data import corpora

SOURCE_KINDS = ("tfds", "folder", "jsonl", "hf")


class _FolderTexts:
  """Random-access texts of a folder's files (None for a file that is not UTF-8)."""

  def __init__(self, folder: str, glob: str):
    from mtp_jax.data import builders
    try:
      self.files = [path for _, path in builders.folder_files(folder, glob)]
    except ValueError as e:
      raise ValueError("--source: " + str(e).split(": ", 1)[1]) from None

  def __len__(self) -> int:
    return len(self.files)

  def text(self, i: int) -> str | None:
    with open(self.files[i], "rb") as f:
      raw = f.read()
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError:
      return None


class _JsonlTexts:
  """Random-access texts of a JSON-lines file, by byte offsets found in one pass."""

  def __init__(self, path: str, key: str):
    self.path, self.key = os.path.expanduser(path), key
    if not os.path.isfile(self.path):
      raise ValueError(f"--source: no file {path!r}")
    offsets, pos = [], 0
    with open(self.path, "rb") as f:
      for line in f:
        if line.strip():
          offsets.append(pos)
        pos += len(line)
    self.offsets = np.asarray(offsets, np.int64)
    if not len(self.offsets):
      raise ValueError(f"--source: {path!r} has no JSON lines")
    self.text(0)  # a missing key or a line that is not JSON: fail before anything is written
    self._file.close()  # workers open their own handle on first use
    self._file = None

  def __len__(self) -> int:
    return len(self.offsets)

  def __getstate__(self):
    return {**self.__dict__, "_file": None}

  def text(self, i: int) -> str:
    if getattr(self, "_file", None) is None:
      self._file = open(self.path, "rb")
    self._file.seek(int(self.offsets[i]))
    line = self._file.readline()
    try:
      value = corpora.record_field(json.loads(line), self.key)
    except (ValueError, KeyError, TypeError, IndexError):
      raise ValueError(f"--text_key: line {i + 1} of {self.path} is not a JSON object with "
                       f"text at {self.key!r}") from None
    if not isinstance(value, str):
      raise ValueError(f"--text_key: {self.key!r} of line {i + 1} of {self.path} is "
                       f"{type(value).__name__}, not text")
    return value


class _TfdsTexts:
  """Random-access texts of a prepared tfds split; each worker opens its own data source."""

  def __init__(self, name: str, data_dir: str, split: str, key: str):
    builder = corpora.tfds_builder(name, data_dir, field="--source")
    corpora.check_text_key(builder, key, field="--text_key")
    self.args = (name, data_dir, split, key)
    self._source = corpora.tfds_split_source(builder, split, field="--split")
    self._len = len(self._source)

  def __len__(self) -> int:
    return self._len

  def __getstate__(self):
    return {**self.__dict__, "_source": None}

  def text(self, i: int) -> str:
    if self._source is None:
      name, data_dir, split, _ = self.args
      self._source = corpora.tfds_builder(name, data_dir).as_data_source(split=split)
    value = corpora.record_field(self._source[i], self.args[3])
    return value.decode("utf-8") if isinstance(value, bytes) else value


class _HfTexts:
  """Random-access texts of a Hugging Face dataset (memory-mapped Arrow), read in blocks.

  The Hub is switched off while loading, so a dataset that is not cached is an error, never a
  download. Workers get the dataset pickled (its Arrow files by path) and read `_BLOCK` rows of
  the text column at a time: nothing holds the whole dataset in memory.
  """

  _BLOCK = 256

  def __init__(self, arg: str, split: str, key: str, cache_dir: str):
    try:
      import datasets
    except ImportError:
      raise ValueError("--source: hf:NAME needs the hf extra: pip install 'mtp_jax[hf]'") from None
    folder, name, config = _parse_hf(arg)
    if folder and any(os.path.isfile(os.path.join(folder, f))
                      for f in ("dataset_dict.json", "state.json")):  # save_to_disk's
      if config:
        raise ValueError(f"--source: {folder!r} was written by save_to_disk and has no configs")
      ds = _split_of_saved(datasets.load_from_disk(folder), split)
    else:
      ds = _load_cached(datasets, folder or name, config, split, cache_dir)
    parts, feature = corpora.split_key(key), ds.features
    for part in parts:
      if not isinstance(feature, dict) or part not in feature:
        keys = ", ".join(map(repr, feature)) if isinstance(feature, dict) else ""
        raise ValueError(f"--text_key: hf:{arg} has no feature {key!r}; features: "
                         + (keys or "none at that level"))
      feature = feature[part]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
      raise ValueError(f"--text_key: {key!r} of hf:{arg} is a {feature!r}, not text")
    self.dataset, self.parts = ds.select_columns(parts[:1]), parts
    self._start, self._block = 0, []

  def __len__(self) -> int:
    return len(self.dataset)

  def text(self, i: int) -> str:
    if not self._start <= i < self._start + len(self._block):
      self._start, self._block = i, self.dataset[i:i + self._BLOCK][self.parts[0]]
    return corpora.record_field(self._block[i - self._start], "/".join(self.parts[1:]))


def _parse_hf(arg: str) -> tuple[str, str, str]:
  """(folder, name, config) of `hf:DIR[:CONFIG]` or `hf:NAME[:CONFIG]`; Hub names hold no ':'."""
  if os.path.isdir(os.path.expanduser(arg)):
    return os.path.expanduser(arg), "", ""
  name, _, config = arg.partition(":")
  if os.path.isdir(os.path.expanduser(name)):
    return os.path.expanduser(name), "", config
  if name.startswith(("/", ".", "~")) or name.count("/") > 1:
    raise ValueError(f"--source: hf:{arg}: no folder {name!r}")
  from datasets import packaged_modules
  if name in packaged_modules._PACKAGED_DATASETS_MODULES:
    raise ValueError(f"--source: hf:{name} is a file format, not a dataset; use jsonl:FILE, "
                     "or hf:DIR for a folder of data files")
  return "", name, config


def _split_of_saved(saved, split: str):
  """The rows of a split string ("train[:99%]", "a+b") of what load_from_disk returned; a lone
  Dataset is the split it was saved from, or "train" as datasets names unsplit data."""
  import datasets
  from datasets.arrow_reader import ReadInstruction
  splits = (dict(saved) if isinstance(saved, datasets.DatasetDict)
            else {str(saved.split or "train"): saved})
  try:
    parts = ReadInstruction.from_spec(split).to_absolute({k: len(v) for k, v in splits.items()})
  except Exception:  # (unknown split or bad slice syntax)
    raise ValueError(f"--split: {split!r} is not a split of the saved dataset (splits: "
                     f"{', '.join(map(repr, splits))}; slices such as 'train[:99%]' allowed)"
                     ) from None
  return datasets.concatenate_datasets(
      [splits[p.splitname].select(range(p.from_, p.to)) for p in parts])


def _load_cached(datasets, path: str, config: str, split: str, cache_dir: str):
  """datasets.load_dataset with the Hub off (as HF_HUB_OFFLINE=1): the cached dataset, or the
  one-line error naming the command that caches it."""
  import huggingface_hub
  where = os.path.expanduser(cache_dir) if cache_dir else datasets.config.HF_DATASETS_CACHE
  spec = f"hf:{path}" + (f":{config}" if config else "")
  offline = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
  datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
  try:
    return datasets.load_dataset(path, config or None, split=split, cache_dir=where)
  except Exception as e:  # (not cached, unknown config or split)
    line = (str(e).splitlines() or [type(e).__name__])[0]
    if not os.path.isdir(path) and (isinstance(e, (ConnectionError, FileNotFoundError))
                                    or "find cache" in line):
      args = ", ".join(map(repr, [path] + [config] * bool(config)))
      raise ValueError(
          f"--source: {spec} is not in the local cache {where} (nothing is downloaded here); on "
          f"a machine with network run python -c \"import datasets; datasets.load_dataset("
          f"{args})\" and copy its cache (or pass it with --hf_cache_dir), or hf download {path} "
          "--repo-type dataset --local-dir DIR and use --source hf:DIR") from None
    field = "--split" if "split" in line.lower() else "--source"
    raise ValueError(f"{field}: {spec} split {split!r}: {line}") from None
  finally:
    datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = offline


def open_source(source: str, *, text_key: str = "text", glob: str = "**/*",
                split: str = "train", tfds_data_dir: str = "", hf_cache_dir: str = ""):
  """The texts `--source KIND:ARG` names, checked (one-line ValueError naming the flag)."""
  kind, _, arg = source.partition(":")
  if kind not in SOURCE_KINDS or not arg:
    raise ValueError(f"--source: got {source!r}, allowed: tfds:NAME, folder:DIR, jsonl:FILE, "
                     "hf:NAME[:CONFIG], hf:DIR")
  if kind == "hf":
    return _HfTexts(arg, split, text_key, hf_cache_dir)
  if kind == "tfds":
    return _TfdsTexts(arg, tfds_data_dir, split, text_key)
  if kind == "folder":
    return _FolderTexts(arg, glob)
  return _JsonlTexts(arg, text_key)


