"""tfds builders that turn local files into ArrayRecord datasets: no download, no TensorFlow.

Two corpus kinds (registered in corpus.py, which makes their builders with the functions at the
end of this file):
  python_code   the `.py` files of the running interpreter's standard library (tests and
                site-packages left out): a code corpus every machine already has.
  text_folder   the files under `data.folder` matching `data.glob` (recursive, hidden files and
                folders skipped): the user's own text or code.
The synthetic tasks (`induction`, `polynomial`) are built in tasks.py.

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
import logging
import os
import pathlib
import re
import sys
import sysconfig

import tensorflow_datasets as tfds

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
    # tfds cannot write an empty split; `corpus.load_source` explains a missing one.
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


def _val_label(d) -> str:
  return f"val{d.val_percent}".replace(".", "p")


def _files_builder(d, cls, name: str, root: str, glob: str, files) -> LocalBuilder:
  config = CorpusConfig(name=name, description=f"{len(files)} files, fingerprint "
                        f"{_fingerprint(files)}", root=root, glob=glob, val_percent=d.val_percent,
                        files=tuple(files))
  return cls(config=config, data_dir=os.path.expanduser(d.dir), file_format="array_record")


def python_code_builder(d) -> LocalBuilder:
  """The builder of the python_code corpus for `data.*`; builds nothing."""
  v = sys.version_info
  return _files_builder(d, PythonCode, f"py{v.major}_{v.minor}_{v.micro}_{_val_label(d)}",
                        "stdlib", "", stdlib_files())


def text_folder_builder(d) -> LocalBuilder:
  """The builder of the text_folder corpus for `data.*` (`data.folder` set); builds nothing."""
  files = folder_files(d.folder, d.glob)
  root = str(pathlib.Path(d.folder).expanduser().resolve())
  key = hashlib.sha1(f"{root}\0{d.glob}".encode("utf-8", "surrogateescape")).hexdigest()[:12]
  label = re.sub(r"[^a-z0-9]+", "_", os.path.basename(root).lower()).strip("_")[:24] or "root"
  return _files_builder(d, TextFolder, f"{label}_{key}_{_val_label(d)}", root, d.glob, files)
