"""Real corpora (issue 15): a tfds dataset built here and read from its files alone, shards from
`python -m mtp_jax.data.prepare`, exact resume on them, per-process splits, one-line errors.

Tiny model (configs/tiny.py); training runs are CLI subprocesses sharing a compilation cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import require

from mtp_jax import config as config_lib
from mtp_jax.config import validation
from mtp_jax.data import corpora, pipeline, prepare, tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ_LEN = 32
BYTE = tokenizers.ByteTokenizer()


def _doc(split: str, i: int) -> str:
  # Lengths from 1 to ~70 bytes: some documents span two rows, some share one.
  return f"{split} {i}: " + "def f(x):\n  return x\n"[: (i * 7) % 23] * (1 + i % 4)


class TinyDocs(tfds.core.GeneratorBasedBuilder):
  """Text nested under doc/body next to a non-text feature, two splits, ArrayRecord files."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, disable_shuffling=True,
        features=tfds.features.FeaturesDict({"doc": {"body": tfds.features.Text(),
                                                     "n": tfds.features.Scalar(np.int32)}}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples("train", 40),
            "validation": self._generate_examples("validation", 9)}

  def _generate_examples(self, split, n):
    for i in range(n):
      yield i, {"doc": {"body": _doc(split, i), "n": i}}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  return tmp_path_factory.mktemp("corpora")


@pytest.fixture(scope="module")
def tfds_dir(root):
  data_dir = str(root / "tfds")
  tfds.disable_progress_bar()
  TinyDocs(data_dir=data_dir, file_format="array_record").download_and_prepare()
  return data_dir


@pytest.fixture(scope="module")
def jsonl(root):
  """60 documents as JSON lines, text nested at meta.text."""
  path = root / "docs.jsonl"
  docs = [_doc("doc", i) for i in range(60)]
  path.write_text("".join(json.dumps({"meta": {"text": d}, "id": i}) + "\n"
                          for i, d in enumerate(docs)))
  return str(path), docs


@pytest.fixture(scope="module")
def prepared(root, jsonl):
  """The prepare CLI, 2 worker processes, 3 shards: (out dir, its stderr, the documents)."""
  out = root / "shards"
  p = subprocess.run([sys.executable, "-m", "mtp_jax.data.prepare", f"--source=jsonl:{jsonl[0]}",
                      "--text_key=meta.text", "--tokenizer=byte", f"--out={out}", "--shards=3",
                      "--workers=2", "--chunk=8"], capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  return str(out), p.stderr, jsonl[1]


def _config(**data):
  c = config_lib.load_file(os.path.join(ROOT, "configs/tiny.py"))
  c.data.update(data)
  return validation.validate(c)


def _tfds_config(data_dir, **extra):
  return _config(corpus="tfds", tfds_name="tiny_docs", tfds_data_dir=data_dir,
                 text_key="doc/body", **extra)


def _docs_of(batches) -> list[str]:
  """The documents of a one-pass stream of packed batches, split at eos (pieces rejoined)."""
  ids = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches])
  cuts = np.flatnonzero(ids == BYTE.eos_id)
  return [BYTE.decode(part) for part in np.split(ids, cuts + 1)[:-1]]


def _one_pass(config, split, **kw):
  """Documents of one pass of `split`, in reading order (train: rows not window-shuffled, see
  the monkeypatch in the tests that read train)."""
  return _docs_of(list(pipeline.make_iterator(config, split, repeat=False, **kw)))


def test_tfds_corpus_reads_nested_text_and_split_slices(tfds_dir, monkeypatch):
  monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW_ROWS", 1)  # rows in packing order
  c = _tfds_config(tfds_dir, train_split="train[:50%]", val_split="validation")
  assert _one_pass(c, "validation") == [_doc("validation", i) for i in range(9)]
  assert sorted(_one_pass(c, "train")) == sorted(_doc("train", i) for i in range(20))
  batch = next(pipeline.make_iterator(c, "train"))
  assert batch["tokens"].shape == (4, SEQ_LEN) and batch["segment_ids"].max() >= 1


def test_prepare_writes_shards_metadata_and_progress(prepared):
  out, stderr, docs = prepared
  assert "docs/s" in stderr and "tokens/s" in stderr and "ETA" in stderr
  with open(os.path.join(out, corpora.METADATA)) as f:
    meta = json.load(f)
  assert meta["documents"] == 60 and meta["dtype"] == "uint16"
  assert meta["tokens"] == sum(len(d.encode()) for d in docs)
  assert meta["tokenizer"]["kind"] == "byte" and meta["tokenizer"]["vocab_size"] == 259
  assert [s["records"] for s in meta["shards"]] == [20, 20, 20]
  from array_record.python.array_record_data_source import ArrayRecordDataSource
  files = sorted(os.path.join(out, s["file"]) for s in meta["shards"])
  source = ArrayRecordDataSource(files)
  # Document k went to shard k mod 3: shard-major order is k = 0, 3, 6, ..., 1, 4, ...
  order = [k for shard in range(3) for k in range(shard, 60, 3)]
  got = [BYTE.decode(np.frombuffer(source[i], np.uint16)) for i in range(len(source))]
  assert got == [docs[k] for k in order]


def test_array_record_splits_are_disjoint_and_complete(prepared, monkeypatch):
  monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW_ROWS", 1)
  out, _, docs = prepared
  c = _config(corpus="array_record", files=f"{out}/tokens-*.array_record", val_percent=10)
  seen = {}
  for split in ("train", "validation"):
    seen[split] = _one_pass(c, split, batch_size=2)
    assert len(set(seen[split])) == len(seen[split])
  assert len(seen["validation"]) == 6  # every 10th of 60 records
  assert not set(seen["train"]) & set(seen["validation"])
  assert sorted(seen["train"] + seen["validation"]) == sorted(docs)


def test_held_out_split_is_a_partition():
  for n in range(0, 45):
    for percent in (1, 5, 10, 33, 50):
      val, train = (corpora.HeldOut(range(n), percent, v) for v in (True, False))
      got_val, got_train = list(val), list(train)
      assert got_val == list(range(0, n, round(100 / percent)))
      assert sorted(got_val + got_train) == list(range(n))
      with pytest.raises(IndexError):
        train[len(train)]


def test_train_state_restores_exactly(prepared):
  """As every host of a pod restores the (same) state from the checkpoint."""
  out = prepared[0]
  c = _config(corpus="array_record", files=f"{out}/tokens-*.array_record")
  it = pipeline.make_iterator(c, "train")
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(4)]
  again = pipeline.make_iterator(c, "train")
  again.set_state(state)
  for want in expected:
    got = next(again)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_array_equal(got["segment_ids"], want["segment_ids"])


# The training CLI on real corpora.


def _env(root):
  return dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(root / "jax_cache"),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")


def _train_cmd(workdir, *overrides):
  return [sys.executable, "-m", "mtp_jax.train", "--config", os.path.join(ROOT, "configs/tiny.py"),
          "--workdir", str(workdir), "--config.train.steps=6", "--config.train.eval_every=3",
          "--config.train.checkpoint_every=3", "--config.train.eval_batches=1", *overrides]


def _train(root, workdir, *overrides):
  p = subprocess.run(_train_cmd(workdir, *overrides), env=_env(root), capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


@pytest.mark.slow
def test_train_cli_on_tfds_corpus_with_eval(root, tfds_dir, tmp_path):
  # The subprocess never imports this file: the dataset is read from its files alone.
  s = _train(root, tmp_path / "run", "--config.data.corpus=tfds",
             "--config.data.tfds_name=tiny_docs", f"--config.data.tfds_data_dir={tfds_dir}",
             "--config.data.text_key=doc.body", "--config.data.val_split=validation[:5]")
  assert s["step"] == 6 and np.isfinite(s["eval/head1_loss"]) and np.isfinite(s["train/loss"])


# Heavy tier: test_train's exact stop/resume on prepared token shards (~30 s); the shards'
# reading and its iterator's exact restore stay in make test (test_train_state_restores_exactly,
# test_rows)
@pytest.mark.heavy
@pytest.mark.slow
def test_prepare_train_stop_resume_matches_straight_run(root, prepared, tmp_path):
  shards = [f"--config.data.files={prepared[0]}/tokens-*.array_record",
            "--config.data.corpus=array_record"]
  straight = _train(root, tmp_path / "straight", *shards)
  assert np.isfinite(straight["eval/head1_loss"])
  stopped = _train(root, tmp_path / "resumed", *shards, "--config.train.stop_at=3")
  assert stopped["step"] == 3
  resumed = _train(root, tmp_path / "resumed", *shards)
  assert resumed["step"] == 6
  assert resumed["params_sha256"] == straight["params_sha256"]


# Heavy tier: four runs (~40 s); which iterator a resume takes is test_rows.py's in make test
@pytest.mark.heavy
@pytest.mark.slow
def test_a_checkpoint_of_the_packing_iterator_resumes_on_shards_read_by_rows(root, prepared,
                                                                             tmp_path):
  """A run stopped on shards without lengths files (as prepare wrote them before reading by
  rows) resumes once they are there, packing on, and ends where a straight run ends; a run
  read by rows, resumed where it would pack, stops with one line and keeps its checkpoint."""
  old = tmp_path / "old"
  shutil.copytree(prepared[0], old)
  for f in old.glob("*" + corpora.LENGTHS_SUFFIX):
    f.unlink()
  shards = lambda d: (f"--config.data.files={d}/tokens-*.array_record",
                      "--config.data.corpus=array_record")
  straight = _train(root, tmp_path / "straight", *shards(prepared[0]))
  assert straight["reads_own_rows"]
  assert _train(root, tmp_path / "run", *shards(old), "--config.train.stop_at=3")["step"] == 3
  resumed = _train(root, tmp_path / "run", *shards(prepared[0]))
  assert (resumed["step"], resumed["reads_own_rows"]) == (6, False)
  assert resumed["params_sha256"] == straight["params_sha256"]
  p = subprocess.run(_train_cmd(tmp_path / "straight", "--config.train.steps=9", *shards(old)),
                     env=_env(root), capture_output=True, text=True, timeout=600)
  assert p.returncode == 2, p.stderr[-2000:]
  assert p.stderr.strip().splitlines()[-1].startswith(
      "error: config.data: checkpoint step 6 read the token shards by rows"), p.stderr[-2000:]
  assert "Traceback" not in p.stderr, p.stderr[-2000:]  # orbax's clean-up joined (checkpoint.py)
  assert sorted(os.listdir(tmp_path / "straight" / "checkpoints")) == ["3", "6"]


def _spm_shards(root, jsonl) -> str:
  """The same documents tokenized by a small SentencePiece model."""
  model = tokenizers.train_sentencepiece(jsonl[1] * 4, str(root / "spm" / "tiny.model"), 300)
  out = str(root / "spm_shards")
  prepare.prepare(f"jsonl:{jsonl[0]}", f"spm:{model}", out, shards=2, workers=0,
                  text_key="meta/text", progress=False)
  return out


@pytest.mark.slow
def test_bad_input_one_line_exit_2_nothing_written(root, tfds_dir, prepared, jsonl, tmp_path):
  truncated = tmp_path / "truncated"
  shutil.copytree(prepared[0], truncated)
  shard = truncated / "tokens-00001-of-00003.array_record"
  shard.write_bytes(shard.read_bytes()[:1000])
  tfds_flags = ["--config.data.corpus=tfds", f"--config.data.tfds_data_dir={tfds_dir}",
                "--config.data.text_key=doc/body"]
  cases = {
      "unknown tfds name": (tfds_flags + ["--config.data.tfds_name=no_such_dataset"],
                            "config.data.tfds_name: no dataset 'no_such_dataset'"),
      "missing text_key": (tfds_flags + ["--config.data.tfds_name=tiny_docs",
                                         "--config.data.text_key=doc/title"],
                           "config.data.text_key: tiny_docs/1.0.0 has no feature 'doc/title'"),
      "empty glob": (["--config.data.corpus=array_record",
                      f"--config.data.files={tmp_path}/nothing-*.array_record"],
                     "config.data.files: no file matches"),
      "truncated shard": (["--config.data.corpus=array_record",
                           f"--config.data.files={truncated}/tokens-*"],
                          "the shard is truncated"),
      "tokenizer mismatch": (["--config.data.corpus=array_record",
                              f"--config.data.files={_spm_shards(root, jsonl)}/tokens-*"],
                             "config.data.tokenizer: the shards in"),
  }
  procs = {}
  for name, (overrides, _) in cases.items():  # side by side: each is mostly import time
    wd = tmp_path / name.replace(" ", "_")
    wd.mkdir()
    (wd / "keep.txt").write_text("precious")
    procs[name] = (wd, subprocess.Popen(_train_cmd(wd, *overrides), env=_env(root),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True))
  for name, (wd, p) in procs.items():
    _, stderr = p.communicate(timeout=300)
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    assert p.returncode == 2, (name, stderr[-2000:])
    assert lines[-1].startswith("error: ") and cases[name][1] in lines[-1], (name, lines[-1])
    assert "Traceback" not in stderr, name
    assert sorted(os.listdir(wd)) == ["keep.txt"], name


def test_prepare_bad_input_one_line_exit_2(root, jsonl, tmp_path):
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=r"^--text_key: line 1 of .* text at 'body'$"):
    prepare.prepare(f"jsonl:{jsonl[0]}", "byte", str(out), text_key="body", workers=0)
  with pytest.raises(ValueError, match=r"^--tokenizer: got 'spm:/nope'"):
    prepare.prepare(f"jsonl:{jsonl[0]}", "spm:/nope", str(out), workers=0)
  assert not out.exists()
  p = subprocess.run([sys.executable, "-m", "mtp_jax.data.prepare", "--source=s3:bucket",
                      f"--out={out}"], capture_output=True, text=True, timeout=120)
  assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: --source: ")
  assert not out.exists()


@pytest.mark.parametrize("data,needle", [
    (dict(corpus="tfds"), "config.data.tfds_name: must name"),
    (dict(corpus="tfds", tfds_name="x", val_split=""), "config.data.val_split: must be"),
    (dict(corpus="array_record"), "config.data.files: must be a glob"),
    (dict(corpus="array_record", files="x", val_percent=0), "config.data.val_percent: must be"),
])
def test_config_fields_of_real_corpora(data, needle):
  with pytest.raises(ValueError, match=f"^{needle}"):
    _config(**data)


@pytest.mark.slow
def test_prepare_hf_source_save_to_disk_and_missing_name(tmp_path):
  """`--source hf:DIR` of a save_to_disk folder (split slices, nested key, a worker process);
  an uncached Hub name is one line, exit 2, nothing written, nothing downloaded."""
  datasets = require("datasets")
  docs = {s: [_doc(s, i) for i in range(n)] for s, n in (("train", 30), ("validation", 5))}
  datasets.DatasetDict({s: datasets.Dataset.from_dict({"doc": [{"body": d, "n": i}
                                                               for i, d in enumerate(ds)]})
                        for s, ds in docs.items()}).save_to_disk(str(tmp_path / "saved"))
  out = tmp_path / "out"
  meta = prepare.prepare(f"hf:{tmp_path}/saved", "byte", str(out), shards=2, workers=1, chunk=4,
                         text_key="doc/body", split="train[:20]+validation", progress=False)
  want = docs["train"][:20] + docs["validation"]
  assert meta["documents"] == 25 and meta["split"] == "train[:20]+validation"
  from array_record.python.array_record_data_source import ArrayRecordDataSource
  for k, shard in enumerate(meta["shards"]):  # document j went to shard j mod 2
    source = ArrayRecordDataSource([str(out / shard["file"])])
    got = [np.frombuffer(source[i], np.uint16) for i in range(len(source))]
    assert len(got) == len(want[k::2])
    for ids, doc in zip(got, want[k::2]):
      np.testing.assert_array_equal(ids, BYTE.encode(doc))
  missing = tmp_path / "missing"
  p = subprocess.run([sys.executable, "-m", "mtp_jax.data.prepare",
                      "--source=hf:mtp-jax-test/no_such_dataset", f"--out={missing}",
                      f"--hf_cache_dir={tmp_path / 'cache'}"],
                     capture_output=True, text=True, timeout=120)
  lines = p.stderr.strip().splitlines()
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
  assert lines[-1].startswith("error: --source: hf:mtp-jax-test/no_such_dataset is not in the "
                              "local cache") and "load_dataset(" in lines[-1], lines
  assert not missing.exists()
