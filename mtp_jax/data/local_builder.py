"""The base of this package's tfds builders (builders.py's file corpora, tasks.py's tasks), and
`build`: a dataset built on first use, rebuilt when its content changed.
"""

from __future__ import annotations

import inspect
import json
import logging

from etils import epath
import tensorflow_datasets as tfds

_log = logging.getLogger(__name__)


class _DropCustomConfigWarning(logging.Filter):
  """Every config here is custom, and tfds says so on each load (also in grain's workers)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Using custom data configuration")


if not any(isinstance(f, _DropCustomConfigWarning) for f in logging.getLogger("absl").filters):
  logging.getLogger("absl").addFilter(_DropCustomConfigWarning())


class LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base of the builders in builders.py and tasks.py.

  Not registered with tfds (builders are made by the corpus kinds, not looked up by name),
  so importing this module twice, or a tfds catalog dataset of the same name, cannot collide.
  """

  def _log_download_bytes(self) -> None:
    """Nothing: tfds would print "Downloading and preparing dataset Unknown size (download:
    Unknown size, ...)" for a build that downloads nothing; `build` prints its own line."""

  def _log_download_done(self) -> None:
    """Nothing, as above ("Dataset ... downloaded and prepared to ...")."""

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    """The file that defines cls. tfds 4.9.10 finds it through `importlib_resources`, a package
    it only declares for Python < 3.9, so building from any installed package fails without this
    (tensorflow/datasets#11212); tfds itself falls back to the same answer."""
    return epath.Path(inspect.getfile(cls))


def _built_description(builder) -> str | None:
  info_path = builder.data_path / "dataset_info.json"
  if not info_path.exists():
    return None
  return json.loads(info_path.read_text()).get("configDescription")


def build(make, what: str) -> LocalBuilder:
  """`make()`'s builder with its dataset built (first use) or rebuilt (the config description,
  which names the content, changed). `what` names the corpus in the one line printed."""
  builder = make()
  built = _built_description(builder)
  if built == builder.builder_config.description:
    return builder
  if built is not None:
    _log.warning("%s: files or generator changed since the build (%s, now %s); rebuilding",
                 builder.data_path, built, builder.builder_config.description)
  mode = tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS  # overwrites a stale build
  print(f"building the {what} dataset ({builder.builder_config.description}) "
        f"into {builder.data_path}", flush=True)
  tfds.disable_progress_bar()  # one line above instead of a screen of progress bars
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(download_mode=mode))
  return make()  # a fresh builder reads the dataset_info just written
