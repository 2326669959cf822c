"""The corpus-kind registry (mtp_jax/data/corpus.py): the pipeline asks it once per dataset, a
registered kind flows to the packer unchanged, and each kind's errors stay one line."""

from __future__ import annotations

import pytest

from mtp_jax import config as config_lib
from mtp_jax.config import validation
from mtp_jax.data import corpus as corpus_lib
from mtp_jax.data import pipeline


def _config(folder, data_dir, **data):
  c = config_lib.base_config()
  c.data.corpus, c.data.folder, c.data.glob = "text_folder", str(folder), "**/*.txt"
  c.data.dir, c.data.seq_len, c.data.val_percent = str(data_dir), 8, 30
  c.train.batch_size = 2
  for field, value in data.items():
    setattr(c.data, field, value)
  return c


@pytest.fixture
def listed_kind():
  """A kind whose documents are three fixed strings: registered for one test only."""

  @corpus_lib.register
  class Listed(corpus_lib.Corpus):
    names = ("listed",)
    texts = ["ab", "cde", "f"]

    def text_source(self, d, split):
      return [{"text": t.encode(), "path": f"{i}".encode()} for i, t in enumerate(self.texts)]

  yield Listed
  del corpus_lib.KINDS["listed"]


def test_registered_kind_reaches_the_packer(listed_kind, monkeypatch):
  c = config_lib.base_config()
  c.data.corpus, c.data.seq_len, c.train.batch_size = "listed", 8, 1
  validation.validate(c)  # the choices of data.corpus are the registry's
  calls = []
  get = corpus_lib.get
  monkeypatch.setattr(corpus_lib, "get", lambda d: calls.append(d.corpus) or get(d))
  batch = next(pipeline.make_iterator(c, "validation"))
  assert calls == ["listed"]  # one look-up per dataset
  eos = 258  # byte tokenizer: ids are the bytes, specials above
  assert batch["tokens"][0].tolist() == [97, 98, eos, 99, 100, 101, eos, 102]
  assert batch["segment_ids"][0].tolist() == [1, 1, 1, 2, 2, 2, 2, 3]


def test_unknown_kind_and_split(tmp_path):
  d = _config(tmp_path, tmp_path / "ds").data
  d.corpus = "wikipedia"
  with pytest.raises(ValueError, match="config.data.corpus: got 'wikipedia', allowed: "
                     "'python_code', 'text_folder', 'induction', 'polynomial', 'tfds', "
                     "'array_record'"):
    corpus_lib.load_source(d, "train")
  c = _config(tmp_path, tmp_path / "ds")
  c.data.corpus = "wikipedia"
  with pytest.raises(ValueError, match="data.corpus"):
    validation.validate(c)
  d.corpus = "polynomial"
  assert corpus_lib.get(d).splits() == ("train", "validation", "test_ood")
  d.corpus = "text_folder"
  with pytest.raises(ValueError, match="split: got 'test', allowed: 'train', 'validation'"):
    corpus_lib.load_source(d, "test")
  with pytest.raises(ValueError, match="'array_record' shards hold token ids, not text"):
    corpus_lib.KINDS["array_record"].text_source(d, "train")


@pytest.mark.parametrize("corpus,field", [("text_folder", "data.folder"),
                                          ("tfds", "data.tfds_name"),
                                          ("array_record", "data.files")])
def test_kind_checks_its_fields(tmp_path, corpus, field):
  c = _config("", tmp_path)
  c.data.corpus = corpus
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    validation.validate(c)


def test_builder_errors(tmp_path):
  (tmp_path / "a.txt").write_text("a")
  d = _config(tmp_path, tmp_path / "ds").data
  d.glob = "**/*.rst"
  with pytest.raises(ValueError, match="data.folder/config.data.glob: no file under"):
    corpus_lib.load_source(d, "train")
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "b.txt").write_bytes(b"\xff\xfe binary")
  d.folder, d.glob = str(tmp_path / "bin"), "*.txt"
  with pytest.raises(ValueError, match="none of the 1 files .* is UTF-8 text"):
    corpus_lib.load_source(d, "train")
  d.folder = str(tmp_path / "missing")
  with pytest.raises(ValueError, match="config.data.folder: .* is not a folder"):
    corpus_lib.load_source(d, "train")
  d.corpus = "wikipedia"
  with pytest.raises(ValueError, match="config.data.corpus: got 'wikipedia', allowed: "
                     "'python_code', 'text_folder', 'induction', 'polynomial', 'tfds', "
                     "'array_record'"):
    corpus_lib.load_source(d, "train")
  d.corpus = "text_folder"
  with pytest.raises(ValueError, match="split: got 'test', allowed: 'train', 'validation'"):
    corpus_lib.load_source(d, "test")
