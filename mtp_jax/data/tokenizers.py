"""Tokenizers: raw UTF-8 bytes by default, SentencePiece trained locally from a corpus, or a
Hugging Face tokenizer.json (`data.tokenizer = "hf"`, data/hf_tokenizer.py).

Both share one small interface (`encode`, `decode`, `pad_id`, `bos_id`, `eos_id`, `vocab_size`)
so the pipeline and the decoder never ask which one they hold. Bytes are the default because they
need no training, cover every text, and round-trip exactly; SentencePiece buys a shorter sequence
per document at the cost of a model file.

Train a SentencePiece model from the train split of a corpus (built on first use):

  python -m mtp_jax.data.tokenizers train --corpus python_code --data_dir DIR \
      --vocab_size 2048 --out PATH.model
  python -m mtp_jax.data.tokenizers train --corpus text_folder --folder F --glob '**/*.md' ...
"""

from __future__ import annotations

import os
import re
import time
from typing import Protocol
from collections.abc import Iterator

import numpy as np
import sentencepiece as spm

from mtp_jax.data import corpus
from mtp_jax.data.hf_tokenizer import CANNOT_ENCODE, HFTokenizer
from mtp_jax.data.hf_tokenizer import resolve as hf_resolve


class Tokenizer(Protocol):
  """What the pipeline and the decoder use; both tokenizers below have it."""

  pad_id: int
  bos_id: int
  eos_id: int
  vocab_size: int

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
    ...

  def decode(self, ids) -> str:
    ...


def _utf8(text: str) -> bytes:
  """UTF-8 bytes of `text`, or one clear ValueError (a lone surrogate has no UTF-8 form)."""
  try:
    return text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(f"{CANNOT_ENCODE}{text[e.start:e.end]!r} at character {e.start} is not "
                     f"valid Unicode ({e.reason})") from None


def _with_specials(ids_T: np.ndarray, bos_id: int, eos_id: int, add_bos: bool,
                   add_eos: bool) -> np.ndarray:
  parts = [np.array([bos_id], np.int32)] if add_bos else []
  parts.append(ids_T.astype(np.int32, copy=False))
  if add_eos:
    parts.append(np.array([eos_id], np.int32))
  return np.concatenate(parts) if len(parts) > 1 else parts[0]


class ByteTokenizer:
  """Ids 0-255 are UTF-8 bytes; 256, 257, 258 are pad, bos, eos (vocab 259, as model.vocab_size)."""

  pad_id = 256
  bos_id = 257
  eos_id = 258
  vocab_size = 259

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
    ids_T = np.frombuffer(_utf8(text), dtype=np.uint8)
    return _with_specials(ids_T, self.bos_id, self.eos_id, add_bos, add_eos)

  def decode(self, ids) -> str:
    """Drops special ids; a byte run that is not UTF-8 (a model's guess) decodes to U+FFFD."""
    ids_T = np.asarray(ids).reshape(-1)
    raw = ids_T[(ids_T >= 0) & (ids_T < 256)].astype(np.uint8).tobytes()
    return raw.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A SentencePiece model loaded by path, with the byte tokenizer's interface.

  The model must define bos and eos ids (models trained by `train_sentencepiece` do); without a
  pad piece (Llama's tokenizer) the unk id pads.
  `encode` refuses text that maps to the unknown piece rather than training on a silent `<unk>`;
  a model trained with `byte_fallback=True` never produces one. With the settings of
  `train_sentencepiece` decode(encode(text)) == text, except that U+2581 ("▁"), SentencePiece's
  own space symbol, comes back as a space.
  """

  def __init__(self, path: str):
    self.path = path
    self._sp = spm.SentencePieceProcessor(model_file=path)
    self.vocab_size = int(self._sp.get_piece_size())
    self.pad_id = int(self._sp.pad_id())
    self.bos_id = int(self._sp.bos_id())
    self.eos_id = int(self._sp.eos_id())
    self.unk_id = int(self._sp.unk_id())
    if self.pad_id < 0 and self.unk_id >= 0:
      # Llama's tokenizer defines no pad piece. Padding is masked by segment ids and cut by
      # lengths when decoding, so any id serves; unk is one no text of ours encodes to.
      self.pad_id = self.unk_id
    for name in ("pad_id", "bos_id", "eos_id"):
      if getattr(self, name) < 0:
        raise ValueError(f"config.data.spm_path: the model {path!r} defines no {name}; train one "
                         "with `python -m mtp_jax.data.tokenizers train`")
    self._special_V = np.zeros(self.vocab_size, bool)
    self._special_V[[self.pad_id, self.bos_id, self.eos_id]] = True

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
    _utf8(text)  # the same one-line error as the byte tokenizer, before the C++ layer sees it
    ids_T = np.asarray(self._sp.encode(text, out_type=int), dtype=np.int32)
    if self.unk_id >= 0 and (ids_T == self.unk_id).any():
      pieces = self._sp.encode(text, out_type=str)
      first = next(p for p, i in zip(pieces, ids_T) if i == self.unk_id)
      raise ValueError(f"{CANNOT_ENCODE}{first!r} maps to the unknown piece of {self.path!r} "
                       "(a model without byte_fallback; train with byte_fallback=True to cover "
                       "every text)")
    return _with_specials(ids_T, self.bos_id, self.eos_id, add_bos, add_eos)

  def decode(self, ids) -> str:
    ids_T = np.asarray(ids).reshape(-1).astype(np.int64)
    ids_T = ids_T[(ids_T >= 0) & (ids_T < self.vocab_size)]
    return self._sp.decode(ids_T[~self._special_V[ids_T]].tolist())


def tokenizer_file(data_config) -> str:
  """The file the config's tokenizer reads ("" for bytes)."""
  if data_config.tokenizer == "sentencepiece":
    return data_config.spm_path
  if data_config.tokenizer == "hf":
    return hf_resolve(data_config.hf_tokenizer)
  return ""


def get_tokenizer(data_config) -> ByteTokenizer | SentencePieceTokenizer | HFTokenizer:
  """The tokenizer `data.tokenizer` names ("byte", "sentencepiece" with `data.spm_path`, "hf"
  with `data.hf_tokenizer`)."""
  kind = data_config.tokenizer
  if kind == "byte":
    return ByteTokenizer()
  if kind == "hf":
    return HFTokenizer(data_config.hf_tokenizer)
  if kind == "sentencepiece":
    path = data_config.spm_path
    if not path or not os.path.isfile(path):
      raise ValueError(f"config.data.spm_path: no SentencePiece model file at {path!r}; train one "
                       "with `python -m mtp_jax.data.tokenizers train --out PATH.model`")
    return SentencePieceTokenizer(path)
  raise ValueError(f"config.data.tokenizer: got {kind!r}, allowed: 'byte', 'sentencepiece', "
                   "'hf'")


def _training_chunks(texts, max_bytes: int) -> Iterator[str]:
  """Whole lines grouped into chunks under `max_bytes`.

  SentencePiece drops training sentences longer than `max_sentence_length`, and a source file is
  far longer than that; cutting at line ends keeps the newlines and indentation it must learn.
  """
  for text in texts:
    chunk, size = [], 0
    for line in text.splitlines(keepends=True):
      n = len(line.encode("utf-8"))
      if chunk and size + n > max_bytes:
        yield "".join(chunk)
        chunk, size = [], 0
      if n <= max_bytes:  # a longer line (minified data, say) teaches nothing: skip it
        chunk.append(line)
        size += n
    if chunk:
      yield "".join(chunk)


def train_sentencepiece(texts, out_path: str, vocab_size: int, *, model_type: str = "unigram",
                        max_sentences: int = 300_000, num_threads: int = 2) -> str:
  """Trains a SentencePiece model on `texts`; writes `out_path` (and a .vocab beside it).

  Settings for code, where whitespace is content: identity normalization, no collapsing of
  spaces, no dummy prefix, whitespace-only pieces allowed (indentation), and byte fallback so any
  UTF-8 text encodes without <unk>. Ids: pad 0, unk 1, bos 2, eos 3. Returns the model path.
  """
  prefix = out_path[:-len(".model")] if out_path.endswith(".model") else out_path
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
  max_bytes = 2048
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=_training_chunks(texts, max_bytes),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        hard_vocab_limit=False,  # a tiny corpus may not have vocab_size pieces to offer
        max_sentence_length=4 * max_bytes,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        num_threads=num_threads,
        minloglevel=2,
    )
  except RuntimeError as e:
    m = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
    if m:  # the 256 byte pieces, 4 special ids and every character of the corpus must fit
      raise ValueError(f"vocab_size: this corpus needs at least {m.group(1)}, got "
                       f"{vocab_size}") from None
    raise
  return prefix + ".model"


def _corpus_texts(data_config) -> Iterator[str]:
  source = corpus.load_source(data_config, "train")
  key = corpus.get(data_config).text_key(data_config)
  for i in range(len(source)):
    yield corpus.record_text(source[i], key)


def main(argv=None) -> None:
  """`argv` without the program name (default sys.argv[1:]). Bad input raises ValueError (one
  line; `python -m` prints it as `error: ...` and exits 2)."""
  from absl import flags
  from mtp_jax import cli
  from mtp_jax.data import fields
  data = fields.data_defaults()

  def define(fv):
    # Not tfds / array_record: a tfds dataset needs data.tfds_name (train the tokenizer on a
    # prepared text folder instead), and array_record shards are tokenized already.
    raw = [c for c, kind in corpus.KINDS.items() if kind.text and c != "tfds"]
    flags.DEFINE_enum("corpus", data.corpus, raw, "corpus to train on", flag_values=fv)
    flags.DEFINE_string("data_dir", data.dir, "where datasets are built (data.dir)",
                        flag_values=fv)
    flags.DEFINE_string("folder", data.folder, "text_folder corpus: root folder", flag_values=fv)
    flags.DEFINE_string("glob", data.glob, "text_folder corpus: files to take", flag_values=fv)
    flags.DEFINE_integer("val_percent", data.val_percent,
                         "must match data.val_percent so validation text stays unseen",
                         flag_values=fv)
    flags.DEFINE_integer("vocab_size", 2048, "pieces in the model", flag_values=fv)
    flags.DEFINE_enum("model_type", "unigram", ("unigram", "bpe"), "SentencePiece model type",
                      flag_values=fv)
    flags.DEFINE_string("out", None, "model file to write, e.g. spm/code2k.model", flag_values=fv)

  commands = {"train": cli.Command(
      "train a SentencePiece model on a corpus's train split", define, ("out",))}
  _, args = cli.parse_command(argv, commands, prog="python -m mtp_jax.data.tokenizers",
                                      usage="\n\n".join(__doc__.split("\n\n")[2:]))
  data.corpus, data.dir, data.folder = args.corpus, args.data_dir, args.folder
  data.glob, data.val_percent = args.glob, args.val_percent
  if data.corpus == "text_folder" and not data.folder:
    raise ValueError("--folder: required with --corpus text_folder")
  start = time.time()
  path = train_sentencepiece(_corpus_texts(data), args.out, args.vocab_size,
                             model_type=args.model_type)
  vocab = SentencePieceTokenizer(path).vocab_size
  print(f"wrote {path} (vocab_size {vocab}, {time.time() - start:.1f}s); use it with "
        f"--config.data.tokenizer=sentencepiece --config.data.spm_path={path} "
        f"--config.model.vocab_size={vocab}")


if __name__ == "__main__":
  from mtp_jax import cli as _cli
  _cli.run(main)
