"""The corpus kinds `data.corpus` names, behind a registry (as the head kinds are).

One `Corpus` per kind owns what is kind-specific on the way from a config to the packer: its
config checks (called by validation, before any file is read), its splits, and how it opens a
split's documents (building a local dataset on first use). The pipeline asks the registry once:

  kind = corpus.get(config.data)                 # one-line error for an unknown kind
  kind.check_split(split)
  source, to_ids = kind.documents(config.data, split, tokenizer, add_bos)

  python_code, text_folder   local tfds builds of files (builders.py)
  induction, polynomial      local tfds builds of generated examples (tasks.py)
  tfds                       a prepared tfds dataset, read as it is (corpora.py)
  array_record               token shards written by `python -m mtp_jax.data.prepare` (corpora.py)

This module imports nothing heavy (tfds, grain) at import time: validation imports it.
"""

from __future__ import annotations

from collections.abc import Callable

from mtp_jax.data import corpora

Fail = Callable[[str, str], None]
KINDS: dict[str, Corpus] = {}
SPLITS = ("train", "validation")


def register(cls: type[Corpus]) -> type[Corpus]:
  """Class decorator: one instance per name in `cls.names` (a class may serve several kinds)."""
  for name in cls.names:
    KINDS[name] = cls(name)
  return cls


def get(data_config) -> Corpus:
  """The kind `data.corpus` names."""
  kind = KINDS.get(data_config.corpus)
  if kind is None:
    raise ValueError(f"config.data.corpus: got {data_config.corpus!r}, allowed: "
                     f"{', '.join(map(repr, KINDS))}")
  return kind


def load_source(data_config, split: str):
  """A random-access source of the text records of `split` ({"text": bytes, "path": bytes} but
  for a tfds corpus, whose text is at `get(data_config).text_key(data_config)`)."""
  kind = get(data_config)
  kind.check_split(split)
  return kind.text_source(data_config, split)


def record_text(record, key: str = "text") -> str:
  """A record's text at `key` ("a/b" for nested features) as str (tfds without TensorFlow hands
  Text features back as bytes)."""
  text = corpora.record_field(record, key)
  return text.decode("utf-8") if isinstance(text, bytes) else text


class Tokenize:
  """Text record -> int32 ids of the whole document (a class: grain's worker processes pickle
  it)."""

  def __init__(self, tokenizer, add_bos: bool, key: str = "text"):
    self.tokenizer = tokenizer
    self.add_bos = add_bos
    self.key = key

  def __call__(self, record):
    from mtp_jax.data.hf_tokenizer import CANNOT_ENCODE
    try:
      return self.tokenizer.encode(record_text(record, self.key), add_bos=self.add_bos,
                                   add_eos=True)
    except ValueError as e:
      path = record["path"] if "path" in record else f"a record's {self.key}"
      path = path.decode() if isinstance(path, bytes) else path
      reason = str(e).removeprefix(CANNOT_ENCODE)  # the file, named as a file
      raise ValueError(f"cannot encode text in {path}: {reason}") from None


class Corpus:
  """A kind of corpus. Subclasses set `names` and override what differs."""

  names: tuple[str, ...] = ()
  text = True  # records hold text (a tokenizer can be trained on them)

  def __init__(self, name: str):
    self.name = name

  def splits(self) -> tuple[str, ...]:
    return SPLITS

  def check_split(self, split: str) -> None:
    """Raises the one-line error for a split the corpus does not have."""
    if split not in self.splits():
      raise ValueError(f"split: got {split!r}, allowed: {', '.join(map(repr, self.splits()))}")

  def check(self, d, m, fail: Fail) -> None:
    """The `data.*` fields this kind reads (`m`: config.model); `fail(field, msg)` raises."""

  def text_key(self, d) -> str:
    """Where a record holds its text."""
    return "text"

  def text_source(self, d, split: str):
    """Random-access text records of `split` (checked by the caller)."""
    raise NotImplementedError

  def documents(self, d, split: str, tokenizer, add_bos: bool):
    """(random-access source, record -> int32 ids with eos, and bos when add_bos) of `split`."""
    return self.text_source(d, split), Tokenize(tokenizer, add_bos, self.text_key(d))


class _LocalBuild(Corpus):
  """A corpus built once into `data.dir` by a tfds builder of this package."""

  def builder(self, d):
    """The builder for `data.*`; builds nothing."""
    raise NotImplementedError

  def prepare(self, d):
    """The builder, with its dataset built (first use) or rebuilt (content changed)."""
    from mtp_jax.data.local_builder import build
    return build(lambda: self.builder(d), self.name)

  def text_source(self, d, split: str):
    builder = self.prepare(d)
    if split not in builder.info.splits:  # a file corpus (tasks have every split)
      raise ValueError(f"config.data.val_percent: the {split} split of {builder.info.full_name} "
                       f"is empty ({len(builder.builder_config.files)} files, val_percent "
                       f"{d.val_percent})")
    return builder.as_data_source(split=split)


@register
class PythonCode(_LocalBuild):
  """The `.py` files of the running interpreter's standard library, without tests."""
  names = ("python_code",)

  def builder(self, d):
    from mtp_jax.data import builders
    return builders.python_code_builder(d)


@register
class TextFolder(_LocalBuild):
  """The files under `data.folder` matching `data.glob`."""
  names = ("text_folder",)

  def check(self, d, m, fail: Fail) -> None:
    if not d.folder:
      fail("data.folder", "must name a folder when data.corpus is 'text_folder'")

  def builder(self, d):
    from mtp_jax.data import builders
    if not d.folder:
      raise ValueError("config.data.folder: must name a folder when data.corpus is 'text_folder'")
    return builders.text_folder_builder(d)


def poly_max_len(n_ops: int, degree: int) -> int:
  """Characters of the longest polynomial-task example with n_ops operations: all binary, 2
  characters each ("* "), degree + 1 per operand, "=" and the answer."""
  return 2 * n_ops + (n_ops + 1) * (degree + 1) + degree


POLY_OPS = "+-*o"  # polynomial task: add, negate, multiply, compose


@register
class Task(_LocalBuild):
  """The synthetic tasks of tasks.py, generated from `data.task_seed`."""
  names = ("induction", "polynomial")

  def splits(self) -> tuple[str, ...]:
    from mtp_jax.data import tasks
    return tasks.SPLITS[self.name]

  def builder(self, d):
    from mtp_jax.data import tasks
    return tasks.get_builder(d)

  def check(self, d, m, fail: Fail) -> None:
    if d.tokenizer != "byte":
      fail("data.tokenizer", f"the {d.corpus} task counts one token per character: it needs "
           f"'byte', got {d.tokenizer!r}")
    if d.task_seed < 0:
      fail("data.task_seed", f"must be >= 0, got {d.task_seed}")
    for field in ("task_train_size", "task_eval_size"):
      if d[field] < 1:
        fail(f"data.{field}", f"must be >= 1, got {d[field]}")
    if self.name == "induction":
      self._check_induction(d, fail)
    else:
      self._check_polynomial(d, m, fail)

  def _check_induction(self, d, fail: Fail) -> None:
    if not 1 <= d.induction_pairs <= 26:
      fail("data.induction_pairs", f"must be in [1, 26] (one uppercase letter each), got "
           f"{d.induction_pairs}")
    if d.induction_repeats < 2:
      fail("data.induction_repeats", f"must be >= 2 (a name must recur to be copied), got "
           f"{d.induction_repeats}")
    need = 2 * d.induction_pairs * d.induction_repeats
    if d.induction_len < need:
      fail("data.induction_len", f"must be >= 2 * induction_pairs * induction_repeats "
           f"({need}), got {d.induction_len}")
    if d.induction_len >= d.seq_len:
      fail("data.induction_len", f"must be < data.seq_len ({d.seq_len}) so an example and its "
           f"eos fit in a row, got {d.induction_len}")

  def _check_polynomial(self, d, m, fail: Fail) -> None:
    if d.poly_modulus not in (2, 3, 5, 7):
      fail("data.poly_modulus", f"must be a prime of one digit (2, 3, 5, 7), got "
           f"{d.poly_modulus}")
    if d.poly_degree < 1:
      fail("data.poly_degree", f"must be >= 1, got {d.poly_degree}")
    ops = str(d.poly_ops)
    if not ops or any(op not in POLY_OPS for op in ops) or len(set(ops)) != len(ops):
      fail("data.poly_ops", f"must be distinct characters of {POLY_OPS!r}, got {ops!r}")
    if d.poly_train_ops < 1:
      fail("data.poly_train_ops", f"must be >= 1, got {d.poly_train_ops}")
    if d.poly_ood_ops <= d.poly_train_ops:
      fail("data.poly_ood_ops", f"must be > data.poly_train_ops ({d.poly_train_ops}), got "
           f"{d.poly_ood_ops}")
    longest = lambda n: poly_max_len(n, d.poly_degree)
    if longest(d.poly_train_ops) >= d.seq_len:
      fail("data.seq_len", f"must be > {longest(d.poly_train_ops)} (the longest polynomial "
           f"example with {d.poly_train_ops} operations, and its eos), got {d.seq_len}")
    if longest(d.poly_ood_ops) > m.max_len:
      fail("model.max_len", f"must be >= {longest(d.poly_ood_ops)} (the longest test_ood "
           f"example, {d.poly_ood_ops} operations), got {m.max_len}")


@register
class Tfds(Corpus):
  """`data.tfds_name` prepared in `data.tfds_data_dir`, its text at `data.text_key`."""
  names = ("tfds",)

  def check(self, d, m, fail: Fail) -> None:
    if not d.tfds_name:
      fail("data.tfds_name", "must name a prepared tfds dataset ('name/config:version') when "
           "data.corpus is 'tfds'")
    for field in ("train_split", "val_split"):
      if not d[field]:
        fail(f"data.{field}", "must be a tfds split string such as 'train' or 'train[:99%]'")

  def text_key(self, d) -> str:
    return d.text_key

  def text_source(self, d, split: str):
    return corpora.tfds_source(d, split)


@register
class TokenShards(Corpus):
  """`data.files` (and `data.val_files`): token shards, one record per document."""
  names = ("array_record",)
  text = False

  def check(self, d, m, fail: Fail) -> None:
    if not d.files:
      fail("data.files", "must be a glob of shards written by `python -m mtp_jax.data.prepare` "
           "when data.corpus is 'array_record'")
    if not d.val_files and not 1 <= d.val_percent <= 50:
      fail("data.val_percent", "must be in [1, 50] (every round(100 / val_percent)-th record "
           f"is held out for validation) when data.val_files is empty, got {d.val_percent}")

  def text_source(self, d, split: str):
    raise ValueError("config.data.corpus: 'array_record' shards hold token ids, not text; "
                     "read them with pipeline.make_iterator")

  def documents(self, d, split: str, tokenizer, add_bos: bool):
    source, meta = corpora.token_source(d, split, tokenizer)
    return source, corpora.DecodeTokens(meta["dtype"], tokenizer.bos_id, tokenizer.eos_id,
                                        add_bos)
