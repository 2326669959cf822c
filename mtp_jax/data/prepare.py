r"""Tokenize a corpus once into ArrayRecord shards for `data.corpus = "array_record"`.

  python -m mtp_jax.data.prepare --source tfds:NAME|folder:DIR|jsonl:FILE|hf:NAME[:CONFIG] \
      [--text_key KEY] --tokenizer byte|spm:PATH|hf:PATH --out DIR [--shards N] [--workers P]

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
Beside each shard, `<shard>.lengths.npy` holds its records' token counts (uint32): what lets
each process of a run read only its own rows (rows.py). `DIR/metadata.json` is written last:
the tokenizer (kind, file, sha256, vocab, special ids), dtype, source, documents, tokens and
each shard's records, tokens and bytes. Training refuses shards without it, shards whose size
differs from it, and a config whose tokenizer differs from it.
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
from mtp_jax.data.sources import open_source

def open_tokenizer(spec: str):
  """(kind, tokenizer, model path) for `--tokenizer byte|spm:PATH|hf:PATH`."""
  if spec == "byte":
    return "byte", tokenizers.ByteTokenizer(), ""
  if spec.startswith("spm:") and os.path.isfile(os.path.expanduser(spec[4:])):
    path = os.path.abspath(os.path.expanduser(spec[4:]))
    return "sentencepiece", tokenizers.SentencePieceTokenizer(path), path
  if spec.startswith("hf:"):
    try:
      tok = tokenizers.HFTokenizer(spec[3:])
    except ValueError as e:
      raise ValueError(f"--tokenizer: {str(e).split(': ', 1)[1]}") from None
    return "hf", tok, os.path.abspath(tok.path)
  raise ValueError(f"--tokenizer: got {spec!r}, allowed: byte, spm:PATH (an existing "
                   "SentencePiece model file), hf:PATH (a tokenizer.json or its folder)")


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


def token_dtype(tokenizer) -> np.dtype:
  """What a shard stores ids as: uint16 while the vocabulary fits, else int32."""
  return np.dtype("uint16" if tokenizer.vocab_size <= 1 << 16 else "int32")


def shard_names(shards: int) -> list[str]:
  return [corpora.SHARD_PATTERN.format(k, shards) for k in range(shards)]


class Shard:
  """One shard file being written: a record per document (its token ids as `dtype` bytes),
  counted. `atomic`: written as NAME.tmp and moved into place by `close`, so a file under its
  own name is complete (distill resumes on that)."""

  def __init__(self, out: str, name: str, dtype, atomic: bool = False):
    from array_record.python import array_record_module
    self.path, self.name, self.itemsize = os.path.join(out, name), name, np.dtype(dtype).itemsize
    self._tmp = self.path + ".tmp" if atomic else self.path
    self._writer = array_record_module.ArrayRecordWriter(self._tmp, corpora.WRITER_OPTIONS)
    self.records = self.tokens = 0
    self.lengths: list[int] = []  # tokens of each record: the lengths file beside the shard

  def write(self, record: bytes) -> None:
    self._writer.write(record)
    self.records += 1
    self.tokens += len(record) // self.itemsize
    self.lengths.append(len(record) // self.itemsize)

  def close(self) -> dict:
    """Closes the file; {"file", "records", "tokens", "bytes"} as metadata.json lists it."""
    self._writer.close()
    corpora.write_lengths(self.path, self.lengths)  # before the shard is in place
    if self._tmp != self.path:
      os.replace(self._tmp, self.path)
    return {"file": self.name, "records": self.records, "tokens": self.tokens,
            "bytes": os.path.getsize(self.path)}


def write_metadata(out: str, meta: dict) -> dict:
  """out/metadata.json, {"format", **meta}, written last and atomically: its presence means
  the shards are complete. Returns what it wrote."""
  meta = {"format": corpora.FORMAT, **meta}
  tmp = os.path.join(out, corpora.METADATA + ".tmp")
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=2)
  os.replace(tmp, os.path.join(out, corpora.METADATA))
  return meta


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
  dtype = token_dtype(tok).name
  n = len(texts)
  os.makedirs(out, exist_ok=True)
  writers = [Shard(out, name, dtype) for name in shard_names(shards)]
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
  done = 0
  tokens = lambda: sum(w.tokens for w in writers)
  try:
    for chunk_records in chunks:
      for record in chunk_records:
        done += 1
        if record is None:
          skipped += 1
          continue
        writers[written % shards].write(record)
        written += 1
      if bar:
        bar.update(done, tokens())
  finally:
    if pool is not None:
      pool.terminate()
    stats = [w.close() for w in writers]
  if bar:
    bar.update(done, tokens(), force=True)
    bar.stream.write("\n")
  return write_metadata(out, {
      "source": source, "text_key": text_key if not source.startswith("folder:") else "",
      "split": split if source.startswith(("tfds:", "hf:")) else "",
      "tokenizer": corpora.tokenizer_record(kind, tok, tok_path),
      "dtype": dtype, "documents": written, "skipped": skipped, "tokens": tokens(),
      "shards": stats,
  })


def main(argv) -> None:
  del argv
  from absl import flags
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
           if t["kind"] == "sentencepiece" else "")
        + (f" --config.data.tokenizer=hf --config.data.hf_tokenizer={t['path']}"
           if t["kind"] == "hf" else ""))


def define_flags() -> None:
  from absl import flags
  flags.DEFINE_string("source", None,
                      "tfds:NAME, folder:DIR, jsonl:FILE, hf:NAME[:CONFIG] or hf:DIR")
  flags.DEFINE_string("tokenizer", "byte", "byte, spm:PATH (a SentencePiece model) or "
                      "hf:PATH (a Hugging Face tokenizer.json or its folder)")
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
  from absl import app
  from mtp_jax import cli
  define_flags()
  app.run(main, flags_parser=cli.parse_flags)  # --help exits 0, a bad flag is one line
