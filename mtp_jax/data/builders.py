"""tfds builders that turn local files into ArrayRecord datasets: no download, no TensorFlow.

Two corpora, chosen by `data.corpus`:
  python_code   the `.py` files of the running interpreter's standard library (tests and
                site-packages left out): a code corpus every machine already has.
  text_folder   the files under `data.folder` matching `data.glob` (recursive, hidden files and
                folders skipped): the user's own text or code.
The synthetic tasks (`induction`, `polynomial`) are built in tasks.py, through `get_builder`;
`load_source` also opens the real corpora of corpora.py (`tfds`: a prepared tfds dataset, read
as it is; `array_record` shards hold tokens, not text, and are opened by the pipeline).

Each record is {"text": the file's UTF-8 text, "path": its path relative to the root}; files
that are not valid UTF-8 are skipped. A file goes to validation when the SHA-1 of its relative
path, mod 100, is below `data.val_percent`: the split is stable across machines and runs, and
adding a file never moves another one between splits.

Datasets are built on first use under `data.dir/<corpus>/<config>/1.0.0/` and reused afterwards.
The config name carries what decides the content (the Python version for python_code, a hash of
folder and glob for text_folder, and val_percent), so two interpreters or two folders never share
a build. The config description records a fingerprint of the file list (paths, sizes, mtimes):
when the files change, the stale build is replaced instead of silently reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import re
import sys
import sysconfig

import tensorflow_datasets as tfds

from mtp_jax.data import corpora
from mtp_jax.data import tasks
from mtp_jax.data.local_builder import LocalBuilder

_log = logging.getLogger(__name__)
SPLITS = ("train", "validation")
# Folders of the standard library that are not library code, or not the standard library.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                               "__pycache__"})


def split_of(rel_path: str, val_percent) -> str:
  """"validation" when sha1(rel_path) mod 100 < val_percent, else "train"."""
  digest = hashlib.sha1(rel_path.encode("utf-8")).digest()
  return "validation" if int.from_bytes(digest[:8], "big") % 100 < val_percent else "train"


def stdlib_files() -> list[tuple[str, str]]:
  """(relative path, absolute path) of the standard library's `.py` files, sorted."""
  root = sysconfig.get_paths()["stdlib"]
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(".")]
    for name in filenames:
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        files.append((pathlib.Path(os.path.relpath(path, root)).as_posix(), path))
  return sorted(files)


def folder_files(folder: str, glob: str) -> list[tuple[str, str]]:
  """(relative path, absolute path) of the files under `folder` matching `glob`, sorted."""
  root = pathlib.Path(folder).expanduser().resolve()
  if not root.is_dir():
    raise ValueError(f"config.data.folder: {folder!r} is not a folder")
  files = []
  for path in root.glob(glob):
    rel = path.relative_to(root)
    if path.is_file() and not any(part.startswith(".") for part in rel.parts):
      files.append((rel.as_posix(), str(path)))
  if not files:
    raise ValueError(f"config.data.folder/config.data.glob: no file under {folder!r} matches "
                     f"{glob!r} (hidden files and folders are skipped)")
  return sorted(files)


def _fingerprint(files) -> str:
  h = hashlib.sha1()
  for rel, path in files:
    st = os.stat(path)
    h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
  return h.hexdigest()[:16]


@dataclasses.dataclass
class CorpusConfig(tfds.core.BuilderConfig):
  """Which files go into a build. `files` is listed once, when the builder is made."""
  root: str = ""
  glob: str = ""
  val_percent: float = 5
  files: tuple = dataclasses.field(default=(), repr=False)  # (relative, absolute) pairs


class _CorpusBuilder(LocalBuilder, skip_registration=True):
  """Writes the config's files as {"text", "path"} records, in sorted-path order per split."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "text and relative path per file; split by path hash"}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=self.__doc__,
        features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                             "path": tfds.features.Text()}),
        # Records stay in sorted-path order; the pipeline does the shuffling, from its seed.
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    cfg = self.builder_config
    by_split = {split: [] for split in SPLITS}
    skipped = 0
    for rel, path in cfg.files:
      if _read_utf8(path) is None:
        skipped += 1
      else:
        by_split[split_of(rel, cfg.val_percent)].append((rel, path))
    if skipped:
      _log.info("%s: skipped %d of %d files that are not UTF-8 text", self.name, skipped,
                len(cfg.files))
    if not any(by_split.values()):
      raise ValueError(f"config.data.folder/config.data.glob: none of the {len(cfg.files)} "
                       f"files under {cfg.root!r} matching {cfg.glob!r} is UTF-8 text")
    # tfds cannot write an empty split; `load_source` explains a missing one.
    return {s: self._generate_examples(files) for s, files in by_split.items() if files}

  def _generate_examples(self, files):
    for rel, path in files:  # read twice (here and when splitting): building only, cheap
      yield rel, {"text": _read_utf8(path), "path": rel}


def _read_utf8(path: str) -> str | None:
  with open(path, "rb") as f:
    raw = f.read()
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    return None


class PythonCode(_CorpusBuilder, skip_registration=True):
  """The `.py` files of the running interpreter's standard library, without tests."""


class TextFolder(_CorpusBuilder, skip_registration=True):
  """The files of a user's folder that match a glob."""


def splits_of(data_config) -> tuple[str, ...]:
  """The splits of the corpus or task `data.corpus` names."""
  return tasks.SPLITS.get(data_config.corpus, SPLITS)


def check_split(data_config, split: str) -> None:
  """Raises the one-line error for a split the corpus or task does not have."""
  allowed = splits_of(data_config)
  if split not in allowed:
    raise ValueError(f"split: got {split!r}, allowed: {', '.join(map(repr, allowed))}")


def get_builder(data_config) -> LocalBuilder:
  """The builder `data.corpus` names, configured from `data.*`; builds nothing."""
  d = data_config
  if d.corpus in tasks.TASKS:
    return tasks.get_builder(d)
  vp = d.val_percent
  val = f"val{vp}".replace(".", "p")
  if d.corpus == "python_code":
    files = stdlib_files()
    v = sys.version_info
    name, cls, root, glob = f"py{v.major}_{v.minor}_{v.micro}_{val}", PythonCode, "stdlib", ""
  elif d.corpus == "text_folder":
    if not d.folder:
      raise ValueError("config.data.folder: must name a folder when data.corpus is 'text_folder'")
    files = folder_files(d.folder, d.glob)
    root = str(pathlib.Path(d.folder).expanduser().resolve())
    key = hashlib.sha1(f"{root}\0{d.glob}".encode("utf-8", "surrogateescape")).hexdigest()[:12]
    label = re.sub(r"[^a-z0-9]+", "_", os.path.basename(root).lower()).strip("_")[:24] or "root"
    name, cls, glob = f"{label}_{key}_{val}", TextFolder, d.glob
  else:
    raise ValueError(f"config.data.corpus: got {d.corpus!r}, a tfds builder is made for "
                     "'python_code', 'text_folder', " + ", ".join(map(repr, tasks.TASKS)))
  config = CorpusConfig(name=name, description=f"{len(files)} files, fingerprint "
                        f"{_fingerprint(files)}", root=root, glob=glob, val_percent=vp,
                        files=tuple(files))
  return cls(config=config, data_dir=os.path.expanduser(d.dir), file_format="array_record")


def _built_description(builder) -> str | None:
  info_path = builder.data_path / "dataset_info.json"
  if not info_path.exists():
    return None
  return json.loads(info_path.read_text()).get("configDescription")


def prepare(data_config) -> LocalBuilder:
  """The builder for `data.*`, with its dataset built (first use) or rebuilt (files changed)."""
  builder = get_builder(data_config)
  built = _built_description(builder)
  if built == builder.builder_config.description:
    return builder
  if built is not None:
    _log.warning("%s: files or generator changed since the build (%s, now %s); rebuilding",
                    builder.data_path, built, builder.builder_config.description)
  mode = tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS  # overwrites a stale build
  print(f"building the {data_config.corpus} dataset ({builder.builder_config.description}) "
        f"into {builder.data_path}", flush=True)
  tfds.disable_progress_bar()  # one line above instead of a screen of progress bars
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(download_mode=mode))
  return get_builder(data_config)  # a fresh builder reads the dataset_info just written


def load_source(data_config, split: str):
  """A random-access source of text records ({"text": bytes, "path": bytes} but for a tfds
  corpus, whose text is at `text_key(data_config)`); builds a local corpus on first use."""
  check_split(data_config, split)
  if data_config.corpus == "tfds":
    return corpora.tfds_source(data_config, split)
  if data_config.corpus == "array_record":
    raise ValueError("config.data.corpus: 'array_record' shards hold token ids, not text; "
                     "read them with pipeline.make_iterator")
  builder = prepare(data_config)
  if split not in builder.info.splits:  # a file corpus (tasks have every split)
    raise ValueError(f"config.data.val_percent: the {split} split of {builder.info.full_name} is "
                     f"empty ({len(builder.builder_config.files)} files, val_percent "
                     f"{data_config.val_percent})")
  return builder.as_data_source(split=split)


def text_key(data_config) -> str:
  """Where a record of the corpus holds its text: data.text_key for tfds, else "text"."""
  return data_config.text_key if data_config.corpus == "tfds" else "text"


def record_text(record, key: str = "text") -> str:
  """A record's text at `key` ("a/b" for nested features) as str (tfds without TensorFlow hands
  Text features back as bytes)."""
  text = corpora.record_field(record, key)
  return text.decode("utf-8") if isinstance(text, bytes) else text
