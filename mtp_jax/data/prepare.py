"""Tokenize a corpus once into ArrayRecord shards for `data.corpus = "array_record"`.

  python -m mtp_jax.data.prepare --source tfds:NAME|folder:DIR|jsonl:FILE|hf:NAME[:CONFIG] \
      [--text_key KEY] --tokenizer byte|spm:PATH --out DIR [--shards N] [--workers P]

Sources: `tfds:NAME` a prepared tfds dataset ("name/config:version", --split, --tfds_data_dir;
read from its ArrayRecord files, nothing downloaded), `folder:DIR` the UTF-8 files under DIR that
match --glob (hidden ones skipped, others that are not UTF-8 skipped and counted), `jsonl:FILE`
one JSON object per line with its text at --text_key, `hf:NAME[:CONFIG]` (the `hf` extra) a
Hugging Face dataset from the local cache only (--split, --hf_cache_dir; the Hub is off, nothing
is downloaded), `hf:DIR` a folder written by `save_to_disk` or of data files (parquet, json,
csv: what `hf download` leaves). Documents are tokenized in P worker processes (chunks of
--chunk documents, in order) and document k goes to shard k mod N: shards are balanced and the
record order is the source's order, whatever P. Each record is the document's ids as
little-endian uint16 (vocab <= 65536) or int32, without bos/eos (the pipeline adds them).
`DIR/metadata.json` is written last: the tokenizer (kind, file, sha256, vocab, special ids),
dtype, source, documents, tokens and each shard's records, tokens and bytes. Training refuses
shards without it, shards whose size differs from it, and a config whose tokenizer differs
from it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

import numpy as np

from mtp_jax.data import corpora
from mtp_jax.data import tokenizers

SOURCE_KINDS = ("tfds", "folder", "jsonl", "hf")


class _FolderTexts:
  """Random-access texts of a folder's files (None for a file that is not UTF-8)."""

  def __init__(self, folder: str, glob: str):
    from mtp_jax.data import builders  # pylint: disable=import-outside-toplevel
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
      import datasets  # pylint: disable=import-outside-toplevel
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
  from datasets import packaged_modules  # pylint: disable=import-outside-toplevel
  if name in packaged_modules._PACKAGED_DATASETS_MODULES:  # pylint: disable=protected-access
    raise ValueError(f"--source: hf:{name} is a file format, not a dataset; use jsonl:FILE, "
                     "or hf:DIR for a folder of data files")
  return "", name, config


def _split_of_saved(saved, split: str):
  """The rows of a split string ("train[:99%]", "a+b") of what load_from_disk returned; a lone
  Dataset is the split it was saved from, or "train" as datasets names unsplit data."""
  import datasets  # pylint: disable=import-outside-toplevel
  from datasets.arrow_reader import ReadInstruction  # pylint: disable=import-outside-toplevel
  splits = (dict(saved) if isinstance(saved, datasets.DatasetDict)
            else {str(saved.split or "train"): saved})
  try:
    parts = ReadInstruction.from_spec(split).to_absolute({k: len(v) for k, v in splits.items()})
  except Exception:  # pylint: disable=broad-except  (unknown split or bad slice syntax)
    raise ValueError(f"--split: {split!r} is not a split of the saved dataset (splits: "
                     f"{', '.join(map(repr, splits))}; slices such as 'train[:99%]' allowed)"
                     ) from None
  return datasets.concatenate_datasets(
      [splits[p.splitname].select(range(p.from_, p.to)) for p in parts])


def _load_cached(datasets, path: str, config: str, split: str, cache_dir: str):
  """datasets.load_dataset with the Hub off (as HF_HUB_OFFLINE=1): the cached dataset, or the
  one-line error naming the command that caches it."""
  import huggingface_hub  # pylint: disable=import-outside-toplevel
  where = os.path.expanduser(cache_dir) if cache_dir else datasets.config.HF_DATASETS_CACHE
  spec = f"hf:{path}" + (f":{config}" if config else "")
  offline = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
  datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
  try:
    return datasets.load_dataset(path, config or None, split=split, cache_dir=where)
  except Exception as e:  # pylint: disable=broad-except  (not cached, unknown config or split)
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


def open_tokenizer(spec: str):
  """(kind, tokenizer, model path) for `--tokenizer byte|spm:PATH`."""
  if spec == "byte":
    return "byte", tokenizers.ByteTokenizer(), ""
  if spec.startswith("spm:") and os.path.isfile(os.path.expanduser(spec[4:])):
    path = os.path.abspath(os.path.expanduser(spec[4:]))
    return "sentencepiece", tokenizers.SentencePieceTokenizer(path), path
  raise ValueError(f"--tokenizer: got {spec!r}, allowed: byte, spm:PATH (an existing "
                   "SentencePiece model file)")


_WORKER: dict = {}


def _init_worker(texts, tokenizer, dtype: str) -> None:
  _WORKER.update(texts=texts, tokenizer=tokenizer, dtype=np.dtype(dtype))


def _encode_range(bounds: tuple[int, int]) -> list[bytes | None]:
  """Records of documents [start, stop): token bytes, None for a skipped (non-UTF-8) file."""
  texts, tok, dtype = _WORKER["texts"], _WORKER["tokenizer"], _WORKER["dtype"]
  out = []
  for i in range(*bounds):
    text = texts.text(i)
    out.append(None if text is None else tok.encode(text).astype(dtype).tobytes())
  return out


class _Progress:
  """One line on stderr, rewritten at most twice a second: documents/s, tokens/s, ETA."""

  def __init__(self, total: int, stream=sys.stderr):
    self.total, self.stream = total, stream
    self.start = self.last = time.time()

  def update(self, docs: int, tokens: int, force: bool = False) -> None:
    now = time.time()
    if not force and now - self.last < 0.5:
      return
    self.last = now
    secs = max(now - self.start, 1e-9)
    eta = (self.total - docs) / max(docs / secs, 1e-9)
    self.stream.write(f"\rprepare: {docs:,}/{self.total:,} documents {docs / secs:,.0f} docs/s "
                      f"{tokens / secs:,.0f} tokens/s ETA {eta:,.0f}s   ")
    self.stream.flush()


def prepare(source: str, tokenizer: str, out: str, *, shards: int = 8, workers: int = 1,
            text_key: str = "text", glob: str = "**/*", split: str = "train",
            tfds_data_dir: str = "", hf_cache_dir: str = "", chunk: int = 256,
            progress: bool = True) -> dict:
  """Writes `out/tokens-*.array_record` and `out/metadata.json`; returns the metadata.

  workers = 0 tokenizes in this process. Every input is checked before `out` is created.
  """
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  if shards < 1:
    raise ValueError(f"--shards: must be >= 1, got {shards}")
  if workers < 0:
    raise ValueError(f"--workers: must be >= 0, got {workers}")
  out = os.path.expanduser(out)
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ValueError(f"--out: {out!r} exists and is not an empty folder")
  kind, tok, tok_path = open_tokenizer(tokenizer)
  texts = open_source(source, text_key=text_key, glob=glob, split=split,
                      tfds_data_dir=tfds_data_dir, hf_cache_dir=hf_cache_dir)
  dtype = "uint16" if tok.vocab_size <= 1 << 16 else "int32"
  n = len(texts)
  os.makedirs(out, exist_ok=True)
  names = [corpora.SHARD_PATTERN.format(k, shards) for k in range(shards)]
  writers = [array_record_module.ArrayRecordWriter(os.path.join(out, name),
                                                   corpora.WRITER_OPTIONS) for name in names]
  records, tokens = np.zeros(shards, np.int64), np.zeros(shards, np.int64)
  written = skipped = 0
  bar = _Progress(n) if progress else None
  ranges = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
  pool = None
  if workers:
    pool = multiprocessing.get_context("spawn").Pool(
        workers, initializer=_init_worker, initargs=(texts, tok, dtype))
    chunks = pool.imap(_encode_range, ranges)
  else:
    _init_worker(texts, tok, dtype)
    chunks = map(_encode_range, ranges)
  done, width = 0, np.dtype(dtype).itemsize
  try:
    for chunk_records in chunks:
      for record in chunk_records:
        done += 1
        if record is None:
          skipped += 1
          continue
        k = written % shards
        writers[k].write(record)
        records[k] += 1
        tokens[k] += len(record) // width
        written += 1
      if bar:
        bar.update(done, int(tokens.sum()))
  finally:
    if pool is not None:
      pool.terminate()
    for w in writers:
      w.close()
  if bar:
    bar.update(done, int(tokens.sum()), force=True)
    bar.stream.write("\n")
  meta = {
      "format": corpora.FORMAT,
      "source": source, "text_key": text_key if not source.startswith("folder:") else "",
      "split": split if source.startswith(("tfds:", "hf:")) else "",
      "tokenizer": corpora.tokenizer_record(kind, tok, tok_path),
      "dtype": dtype, "documents": written, "skipped": skipped, "tokens": int(tokens.sum()),
      "shards": [{"file": name, "records": int(r), "tokens": int(t),
                  "bytes": os.path.getsize(os.path.join(out, name))}
                 for name, r, t in zip(names, records, tokens)],
  }
  tmp = os.path.join(out, corpora.METADATA + ".tmp")
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=2)
  os.replace(tmp, os.path.join(out, corpora.METADATA))  # last: its presence means complete
  return meta


def main(argv) -> None:
  del argv
  from absl import flags  # pylint: disable=import-outside-toplevel
  f = flags.FLAGS
  try:
    start = time.time()
    meta = prepare(f.source, f.tokenizer, f.out, shards=f.shards, workers=f.workers,
                   text_key=f.text_key, glob=f.glob, split=f.split,
                   tfds_data_dir=f.tfds_data_dir, hf_cache_dir=f.hf_cache_dir, chunk=f.chunk)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  t = meta["tokenizer"]
  print(f"wrote {meta['documents']:,} documents, {meta['tokens']:,} tokens in "
        f"{len(meta['shards'])} shards to {f.out} ({time.time() - start:.1f}s); train with "
        f"--config.data.corpus=array_record --config.data.files='{f.out}/tokens-*.array_record'"
        + (f" --config.data.tokenizer=sentencepiece --config.data.spm_path={t['path']}"
           if t["kind"] == "sentencepiece" else ""))


def define_flags() -> None:
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("source", None,
                      "tfds:NAME, folder:DIR, jsonl:FILE, hf:NAME[:CONFIG] or hf:DIR")
  flags.DEFINE_string("tokenizer", "byte", "byte or spm:PATH (a SentencePiece model)")
  flags.DEFINE_string("out", None, "folder to write (must not exist or be empty)")
  flags.DEFINE_integer("shards", 8, "ArrayRecord files to write")
  flags.DEFINE_integer("workers", max(1, (os.cpu_count() or 2) - 1),
                       "tokenizer processes (0: in this process)")
  flags.DEFINE_string("text_key", "text",
                      "tfds / hf feature or JSON key of the text ('a/b' nested)")
  flags.DEFINE_string("glob", "**/*", "folder source: files to take")
  flags.DEFINE_string("split", "train", "tfds / hf source: split string ('train[:1%]')")
  flags.DEFINE_string("tfds_data_dir", "", "tfds source: data dir ('' = tfds default)")
  flags.DEFINE_string("hf_cache_dir", "", "hf source: datasets cache ('' = HF_DATASETS_CACHE)")
  flags.DEFINE_integer("chunk", 256, "documents per worker task")
  flags.mark_flags_as_required(["source", "out"])


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  define_flags()
  app.run(main)
