"""The base of this package's tfds builders (builders.py's file corpora, tasks.py's tasks).

Its own module so that builders.py can dispatch to tasks.py while tasks.py subclasses the base:
imports go builders -> tasks -> local_builder, never back.
"""

from __future__ import annotations

import inspect
import logging

from etils import epath
import tensorflow_datasets as tfds


class _DropCustomConfigWarning(logging.Filter):
  """Every config here is custom, and tfds says so on each load (also in grain's workers)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Using custom data configuration")


if not any(isinstance(f, _DropCustomConfigWarning) for f in logging.getLogger("absl").filters):
  logging.getLogger("absl").addFilter(_DropCustomConfigWarning())


class LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base of the builders in builders.py and tasks.py.

  Not registered with tfds (builders are made by `builders.get_builder`, not looked up by name),
  so importing this module twice, or a tfds catalog dataset of the same name, cannot collide.
  """

  def _log_download_bytes(self) -> None:
    """Nothing: tfds would print "Downloading and preparing dataset Unknown size (download:
    Unknown size, ...)" for a build that downloads nothing; builders.prepare prints its own line."""

  def _log_download_done(self) -> None:
    """Nothing, as above ("Dataset ... downloaded and prepared to ...")."""

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    """The file that defines cls. tfds 4.9.10 finds it through `importlib_resources`, a package
    it only declares for Python < 3.9, so building from any installed package fails without this
    (tensorflow/datasets#11212); tfds itself falls back to the same answer."""
    return epath.Path(inspect.getfile(cls))
