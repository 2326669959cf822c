"""Data package: tokenizers, tfds builders, the grain pipeline. CPU only, a few seconds in all.

Most tests use a text_folder corpus of a few dozen small files in a tmp folder, so every build
takes a fraction of a second; one test builds python_code (the stdlib, well under a second).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import sentencepiece as spm

from mtp_jax import config as config_lib
from mtp_jax import steps as steps_lib
from mtp_jax.data import builders
from mtp_jax.data import corpus as corpus_lib
from mtp_jax.data import pipeline
from mtp_jax.data import tokenizers

TRICKY = [
    "",
    "plain ascii\n",
    "tabs\tand\r\nCRLF and a NUL \x00 byte",
    "héllo wörld, naïve café",
    "漢字かなカナ한국어",
    "emoji 🤖 family 👨‍👩‍👧 flag 🇺🇦 skin 👍🏽",
    "combining e\u0301 and a\u030a, RTL שלום مرحبا",
    "\ufeffBOM, noncharacter \uffff, astral 𝔘𝔫𝔦, replacement \ufffd",
    "    def f(x):\n        return x  # ▁ lower one eighth block\n",
]
SEQ_LEN = 32
BYTE = tokenizers.ByteTokenizer()


def _write_corpus(root) -> dict[str, str]:
  """A few dozen .txt files of 1 to ~300 bytes, plus files the glob or the UTF-8 check skip."""
  rng = np.random.default_rng(0)
  words = ["def", "return", "x", "=", "(", ")", "\n", "    ", "é", "🤖", "lambda", "0", "1"]
  texts = {}
  for i in range(30):
    n = int(rng.integers(1, 80))
    texts[f"doc{i:02d}.txt"] = f"#{i} " + " ".join(rng.choice(words, n))
  texts["sub/deep/nested.txt"] = "nested file\n" * 3
  for rel, text in texts.items():
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
      f.write(text)
  (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: skipped
  (root / "notes.md").write_text("not matched by the glob")
  (root / ".hidden").mkdir()
  (root / ".hidden" / "secret.txt").write_text("hidden folders are skipped")
  return texts


def _config(folder, data_dir, **data):
  c = config_lib.base_config()
  c.data.corpus, c.data.folder, c.data.glob = "text_folder", str(folder), "**/*.txt"
  c.data.dir, c.data.seq_len, c.data.val_percent = str(data_dir), SEQ_LEN, 30
  c.train.batch_size = 4
  for field, value in data.items():
    setattr(c.data, field, value)
  return c


def _iterator(c, split, **kwargs):
  return pipeline.make_iterator(c, split, **kwargs)


def _stream_docs(batches, eos_id=BYTE.eos_id, pad_id=BYTE.pad_id) -> list[str]:
  """Documents recovered from unshuffled batches: concatenate real tokens, cut after eos."""
  tokens = np.concatenate([b["tokens"].reshape(-1) for b in batches])
  tokens = tokens[tokens != pad_id]
  cuts = np.flatnonzero(tokens == eos_id)
  return [BYTE.decode(doc) for doc in np.split(tokens, cuts + 1)[:-1]]


def _assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["segment_ids"], b["segment_ids"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """(folder, data_dir, texts by relative path), built once for the module."""
  folder = tmp_path_factory.mktemp("corpus")
  texts = _write_corpus(folder)
  data_dir = tmp_path_factory.mktemp("datasets")
  data = _config(folder, data_dir).data
  corpus_lib.get(data).prepare(data)
  return folder, data_dir, texts


# Tokenizers.


@pytest.mark.parametrize("text", TRICKY)
def test_byte_round_trip(text):
  ids_T = BYTE.encode(text, add_bos=True, add_eos=True)
  assert ids_T.dtype == np.int32
  assert ids_T[0] == BYTE.bos_id and ids_T[-1] == BYTE.eos_id
  np.testing.assert_array_equal(ids_T[1:-1], np.frombuffer(text.encode("utf-8"), np.uint8))
  assert BYTE.decode(ids_T) == text
  assert BYTE.decode(list(ids_T) + [BYTE.pad_id] * 3) == text


def test_byte_tokenizer_rejects_lone_surrogate_and_replaces_invalid_bytes():
  with pytest.raises(ValueError, match="cannot encode.*'\\\\ud800' at character 2"):
    BYTE.encode("ab\ud800cd")
  assert BYTE.decode([0xFF, ord("a"), 0xC3]) == "\ufffda\ufffd"
  assert BYTE.vocab_size == 259 == config_lib.base_config().model.vocab_size


def test_get_tokenizer_errors(tmp_path):
  d = config_lib.base_config().data
  assert isinstance(tokenizers.get_tokenizer(d), tokenizers.ByteTokenizer)
  d.tokenizer, d.spm_path = "sentencepiece", str(tmp_path / "missing.model")
  with pytest.raises(ValueError, match="data.spm_path"):
    tokenizers.get_tokenizer(d)
  d.tokenizer = "words"
  with pytest.raises(ValueError, match="data.tokenizer"):
    tokenizers.get_tokenizer(d)


def test_sentencepiece_cli_round_trip_and_pipeline(corpus, tmp_path, capsys):
  folder, data_dir, _ = corpus
  out = str(tmp_path / "spm" / "tiny.model")
  argv = ["train", "--corpus", "text_folder", "--folder", str(folder), "--glob", "**/*.txt",
          "--data_dir", str(data_dir), "--val_percent", "30", "--vocab_size", "400", "--out", out]
  tokenizers.main(argv)
  assert f"wrote {out}" in capsys.readouterr().out
  tok = tokenizers.SentencePieceTokenizer(out)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3) and 264 < tok.vocab_size <= 400
  for text in TRICKY[:-1]:  # SentencePiece decodes its own space symbol "▁" as a space
    ids_T = tok.encode(text, add_bos=True, add_eos=True)
    assert ids_T.dtype == np.int32 and ids_T[0] == tok.bos_id and ids_T[-1] == tok.eos_id
    assert tok.decode(ids_T) == text
  with pytest.raises(ValueError, match="cannot encode"):
    tok.encode("ab\ud800cd")
  with pytest.raises(ValueError, match="vocab_size: this corpus needs at least"):
    tokenizers.main(argv[:-4] + ["--vocab_size", "270", "--out", out])

  c = _config(folder, data_dir, tokenizer="sentencepiece", spm_path=out)
  batch = next(_iterator(c, "validation"))
  assert batch["tokens"].shape == (4, SEQ_LEN) and batch["tokens"].max() < tok.vocab_size
  assert (batch["tokens"][batch["segment_ids"] == 0] == tok.pad_id).all()


def test_sentencepiece_refuses_unknown_pieces(tmp_path):
  """A model without byte fallback maps unseen characters to <unk>: refuse, don't train on it."""
  prefix = str(tmp_path / "nofallback")
  spm.SentencePieceTrainer.train(sentence_iterator=iter(["abc abd bcd"] * 20), vocab_size=12,
                                 model_prefix=prefix, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                                 hard_vocab_limit=False, minloglevel=2)
  tok = tokenizers.SentencePieceTokenizer(prefix + ".model")
  assert tok.decode(tok.encode("abc")) == "abc"
  with pytest.raises(ValueError, match="cannot encode: '.*漢.*' maps to the unknown piece"):
    tok.encode("ab 漢")


# Builders.


def test_splits_disjoint_deterministic_and_skip_rules(corpus, tmp_path):
  folder, data_dir, texts = corpus
  d = _config(folder, data_dir).data
  paths = {}
  for split in corpus_lib.SPLITS:
    src = corpus_lib.load_source(d, split)
    paths[split] = [src[i]["path"].decode() for i in range(len(src))]
    assert paths[split] == sorted(paths[split])
    for i, rel in enumerate(paths[split]):
      assert builders.split_of(rel, 30) == split
      assert corpus_lib.record_text(src[i]) == texts[rel]
  assert not set(paths["train"]) & set(paths["validation"])
  assert set(paths["train"]) | set(paths["validation"]) == set(texts)  # no latin1/md/hidden
  assert paths["train"] and paths["validation"]
  # The same files in another data dir split the same way.
  other = corpus_lib.load_source(_config(folder, tmp_path).data, "validation")
  assert [other[i]["path"].decode() for i in range(len(other))] == paths["validation"]


def test_builder_reused_and_rebuilt_when_files_change(tmp_path, monkeypatch):
  folder = tmp_path / "src"
  folder.mkdir()
  for i in range(6):
    (folder / f"f{i}.txt").write_text(f"file {i}\n")
  calls = []
  generate = builders._CorpusBuilder._split_generators
  monkeypatch.setattr(builders._CorpusBuilder, "_split_generators",
                      lambda self, dl: calls.append(1) or generate(self, dl))
  c = _config(folder, tmp_path / "ds", val_percent=0)
  assert len(corpus_lib.load_source(c.data, "train")) == 6 and len(calls) == 1
  corpus_lib.load_source(c.data, "train")
  next(_iterator(c, "train"))
  assert len(calls) == 1  # reused: not rebuilt
  with pytest.raises(ValueError, match="val_percent.*validation split .* is empty"):
    corpus_lib.load_source(c.data, "validation")

  (folder / "f0.txt").write_text("changed, and longer\n")
  src = corpus_lib.load_source(c.data, "train")
  assert len(calls) == 2 and corpus_lib.record_text(src[0]) == "changed, and longer\n"
  # Another glob over the same folder is another build, beside the first.
  c2 = _config(folder, tmp_path / "ds", val_percent=0, glob="f[0-2].txt")
  assert len(corpus_lib.load_source(c2.data, "train")) == 3 and len(calls) == 3
  path = lambda d: corpus_lib.get(d).builder(d).data_path
  assert path(c2.data) != path(c.data)


def test_python_code_corpus(tmp_path):
  d = config_lib.base_config().data
  d.dir = str(tmp_path)
  builder = corpus_lib.get(d).prepare(d)
  v = sys.version_info
  assert builder.builder_config.name == f"py{v.major}_{v.minor}_{v.micro}_val5"
  train, val = (corpus_lib.load_source(d, s) for s in corpus_lib.SPLITS)
  paths = {s: {src[i]["path"].decode() for i in range(len(src))}
           for s, src in (("train", train), ("validation", val))}
  assert len(paths["train"]) > 300 and 5 < len(paths["validation"]) < len(paths["train"]) // 8
  assert not paths["train"] & paths["validation"]
  everything = paths["train"] | paths["validation"]
  assert {"os.py", "json/decoder.py"} <= everything
  assert not any(p.startswith(("test/", "site-packages/")) or "/idle_test/" in p
                 or "/tests/" in p for p in everything)


# Pipeline.


def test_pack_hand_worked_example():
  """Docs of 3 and 4 tokens (eos included) into rows of 4: the second doc spills over."""
  import grain
  docs = [np.array([10, 11, 12], np.int32), np.array([20, 21, 22, 23], np.int32)]
  ds = pipeline.PackIterDataset(grain.MapDataset.source(docs).to_iter_dataset(), seq_len=4,
                                pad_id=99)
  rows = list(ds)
  np.testing.assert_array_equal([r["tokens"] for r in rows], [[10, 11, 12, 20], [21, 22, 23, 99]])
  np.testing.assert_array_equal([r["segment_ids"] for r in rows], [[1, 1, 1, 2], [1, 1, 1, 0]])


def test_pack_whole_docs_hand_worked_example():
  """data.whole_docs: a document that does not fit in the rest of a row starts the next one, one
  longer than a row is still cut; a restored state (through JSON) gives the same rows."""
  import grain
  docs = [np.arange(10, 13), np.arange(20, 24), np.arange(30, 32), np.arange(40, 47)]
  ds = pipeline.PackIterDataset(
      grain.MapDataset.source([d.astype(np.int32) for d in docs]).to_iter_dataset(), seq_len=5,
      pad_id=99, whole_docs=True)
  it = iter(ds)
  rows, states = [], []
  for _ in range(5):
    states.append(json.loads(json.dumps(it.get_state())))
    rows.append(next(it))
  assert list(it) == []
  np.testing.assert_array_equal([r["tokens"] for r in rows], [
      [10, 11, 12, 99, 99], [20, 21, 22, 23, 99], [30, 31, 99, 99, 99], [40, 41, 42, 43, 44],
      [45, 46, 99, 99, 99]])
  np.testing.assert_array_equal([r["segment_ids"] for r in rows], [
      [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
  for k in (1, 2, 4):
    restored = iter(ds)
    restored.set_state(states[k])
    _assert_same(list(restored), rows[k:])


def test_pipeline_hand_worked_example(tmp_path):
  """Two files "ab" and "cde" through the whole pipeline: bytes + eos, packed, padded batch."""
  names = [n for n in (f"d{i}.txt" for i in range(50))
           if builders.split_of(n, 50) == "validation"][:2]
  (tmp_path / names[0]).write_text("ab")
  (tmp_path / names[1]).write_text("cde")
  c = _config(tmp_path, tmp_path / "ds", seq_len=4, val_percent=50)
  (batch,) = list(_iterator(c, "validation", batch_size=3))
  eos, pad = BYTE.eos_id, BYTE.pad_id
  np.testing.assert_array_equal(batch["tokens"], [[97, 98, eos, 99], [100, 101, eos, pad],
                                                  [pad] * 4])
  np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 2], [1, 1, 1, 0], [0] * 4])
  (bos_batch,) = list(_iterator(c, "validation", batch_size=3, add_bos=True))
  assert bos_batch["tokens"][0].tolist() == [BYTE.bos_id, 97, 98, eos]


def test_validation_is_one_ordered_pass_of_every_document(corpus):
  folder, data_dir, texts = corpus
  c = _config(folder, data_dir)
  batches = list(_iterator(c, "validation"))
  val = sorted(p for p in texts if builders.split_of(p, 30) == "validation")
  assert _stream_docs(batches) == [texts[p] for p in val]
  n_tokens = sum(len(texts[p].encode()) + 1 for p in val)
  assert len(batches) == -(-n_tokens // (4 * SEQ_LEN))  # nothing dropped, little padding
  assert all(b["tokens"].shape == (4, SEQ_LEN) and b["tokens"].dtype == np.int32
             for b in batches)


def test_rows_are_well_formed(corpus):
  folder, data_dir, _ = corpus
  it = _iterator(_config(folder, data_dir), "train")
  for _ in range(20):
    batch = next(it)
    for tokens_S, seg_S in zip(batch["tokens"], batch["segment_ids"]):
      assert seg_S[0] == 1 and (np.diff(seg_S) >= 0).all()
      assert ((tokens_S == BYTE.pad_id) == (seg_S == 0)).all()
      real_S = seg_S[seg_S > 0]
      assert (np.diff(real_S) <= 1).all()  # ids go 1, 2, 3, ...
      ends = np.flatnonzero(np.diff(seg_S) != 0)  # a segment that ends inside a row is a doc end
      assert (tokens_S[ends[seg_S[ends + 1] > 0]] == BYTE.eos_id).all()


def test_train_is_deterministic_and_reshuffled_each_epoch(corpus, monkeypatch):
  folder, data_dir, texts = corpus
  c = _config(folder, data_dir)
  a, b = _iterator(c, "train"), _iterator(c, "train")
  _assert_same([next(a) for _ in range(15)], [next(b) for _ in range(15)])
  c_other = _config(folder, data_dir, shuffle_seed=1)
  assert not np.array_equal(next(_iterator(c, "train"))["tokens"],
                            next(_iterator(c_other, "train"))["tokens"])

  monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW_ROWS", 1)  # rows in packing order
  train = [texts[p] for p in sorted(texts) if builders.split_of(p, 30) == "train"]
  it = _iterator(c, "train")
  docs = _stream_docs([next(it) for _ in range(3 * len(train))])[:2 * len(train)]
  epoch1, epoch2 = docs[:len(train)], docs[len(train):]
  assert sorted(epoch1) == sorted(epoch2) == sorted(train)
  assert epoch1 != epoch2 and epoch1 != train


@pytest.mark.parametrize("window", [pipeline.SHUFFLE_WINDOW_ROWS, 64])
def test_train_state_restores_exactly(corpus, monkeypatch, window):
  """Restored from any step (also through JSON, as orbax stores it): the same next batches.

  With 64-row windows (16 batches of 4) restores land on and inside window boundaries.
  """
  monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW_ROWS", window)
  folder, data_dir, _ = corpus
  c = _config(folder, data_dir)
  it = _iterator(c, "train")
  states, batches = [], []
  for _ in range(40):  # about three epochs of this corpus
    states.append(it.get_state())
    batches.append(next(it))
  for k in (0, 1, 6, 16, 17, 39):
    for state in (states[k], json.loads(json.dumps(states[k]))):
      restored = _iterator(c, "train")
      restored.set_state(state)
      _assert_same([next(restored) for _ in range(40 - k)], batches[k:])


def test_validation_state_restores_mid_pass_and_at_end(corpus):
  folder, data_dir, _ = corpus
  c = _config(folder, data_dir)
  it = _iterator(c, "validation", batch_size=1)
  all_batches = list(_iterator(c, "validation", batch_size=1))
  next(it), next(it)
  state = json.loads(json.dumps(it.get_state()))
  restored = _iterator(c, "validation", batch_size=1)
  restored.set_state(state)
  _assert_same(list(restored), all_batches[2:])
  restored.set_state(json.loads(json.dumps(restored.get_state())))
  assert list(restored) == []


def test_batches_are_global_and_independent_of_the_process_count(corpus, monkeypatch):
  """Every process makes the same global batch of train.batch_size rows from all documents
  (sharding.shard_batch then hands each its own rows): what a process reads does not depend on
  its index or on how many there are (tests/integration/test_multihost.py runs two)."""
  import jax
  folder, data_dir, texts = corpus
  c = _config(folder, data_dir)
  c.train.batch_size = 8
  val = [texts[p] for p in sorted(texts) if builders.split_of(p, 30) == "validation"]
  first = list(_iterator(c, "validation"))
  assert first[0]["tokens"].shape == (8, SEQ_LEN)
  assert _stream_docs(first) == val
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  again = list(_iterator(c, "validation"))
  assert steps_lib.batches_sha256(again) == steps_lib.batches_sha256(first)
