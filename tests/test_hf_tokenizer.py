"""`data.tokenizer = "hf"` (a tokenizer.json read with `tokenizers`) encodes and decodes like
transformers' PreTrainedTokenizerFast on the same files, feeds `prepare --tokenizer hf:PATH` and
the data pipeline; a tokenizer without byte fallback is warned about at import (`convert`) and a
text it cannot encode names its corpus file at training."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import sentencepiece as spm
from conftest import require, tiny_config

from mtp_jax.convert import workdir
from mtp_jax.data import corpus, pipeline, prepare, tokenizers

TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n",
         "naïve café → λx: x², 漢字 and emoji 🙂\n",
         "class Point:\n    x: int = 0\n"] * 10
PROBES = TEXTS[:4] + ["", " ", "\t\tindent", "  x = {'k': [1, 2]}  # comment", "<s>a</s>"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A byte-level BPE with a Llama 3 style template (<s> first) and tokenizer_config.json."""
  lib = require("tokenizers")
  from tokenizers import (
      decoders, models, pre_tokenizers, processors, trainers)
  folder = tmp_path_factory.mktemp("bpe")
  tok = lib.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>",
       "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
       "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}))
  return str(folder)


def test_encodes_and_decodes_like_transformers(bpe):
  transformers = require("transformers")
  fast = transformers.AutoTokenizer.from_pretrained(bpe)
  assert isinstance(fast, transformers.PreTrainedTokenizerFast)  # TokenizersBackend in v5
  ours = tokenizers.HFTokenizer(bpe)
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (fast.bos_token_id, fast.eos_token_id,
                                                     fast.pad_token_id) == (1, 2, 0)
  assert ours.vocab_size == len(fast) and ours.prompt_bos
  for text in PROBES:
    plain = fast.encode(text, add_special_tokens=False)
    assert list(ours.encode(text)) == plain, text
    assert list(ours.encode(text, add_bos=ours.prompt_bos)) == fast.encode(text), text
    assert list(ours.encode(text, add_eos=True)) == plain + [fast.eos_token_id]
    ids = ours.encode(text, add_bos=True, add_eos=True)
    assert ours.decode(ids) == fast.decode(ids, skip_special_tokens=True)
    if "<s>" not in text:
      assert ours.decode(ids) == text


def test_config_json_ids_and_bad_files(tmp_path, bpe):
  """Without tokenizer_config.json the ids come from config.json (eos a list: the first);
  no eos, a missing file or a token not in the vocabulary: one line naming the field."""
  folder = tmp_path / "ids"
  folder.mkdir()
  (folder / "tokenizer.json").write_bytes(open(os.path.join(bpe, "tokenizer.json"), "rb").read())
  (folder / "config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": None}))
  tok = tokenizers.HFTokenizer(str(folder / "tokenizer.json"))
  assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.has_bos, tok.prompt_bos) == (2, 2, 2, False,
                                                                                False)
  (folder / "config.json").write_text("{}")
  with pytest.raises(ValueError, match="^config.data.hf_tokenizer: .* names no eos token"):
    tokenizers.HFTokenizer(str(folder))
  with pytest.raises(ValueError, match="^config.data.hf_tokenizer: no tokenizer.json at"):
    tokenizers.HFTokenizer(str(tmp_path / "none"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eot>"}))
  with pytest.raises(ValueError, match="eos_token '<eot>' is not in"):
    tokenizers.HFTokenizer(str(folder))
  c = tiny_config()
  c.data.tokenizer = "hf"
  from mtp_jax.config import validation
  with pytest.raises(ValueError, match="^config.data.hf_tokenizer: must name a tokenizer.json"):
    validation.validate(c)


def test_prepare_and_pipeline_with_hf_tokenizer(bpe, tmp_path):
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:8]))
  out = str(tmp_path / "shards")
  meta = prepare.prepare(f"jsonl:{jsonl}", f"hf:{bpe}", out, shards=2, workers=0,
                         progress=False)
  tok = tokenizers.HFTokenizer(bpe)
  assert meta["tokenizer"]["kind"] == "hf" and meta["tokenizer"]["eos_id"] == tok.eos_id
  want = sum(len(tok.encode(t)) for t in TEXTS[:8])
  assert meta["tokens"] in (want, want + 8)  # with or without an eos per document
  c = tiny_config()
  c.model.vocab_size = tok.vocab_size
  c.data.corpus, c.data.files = "array_record", f"{out}/tokens-*.array_record"
  c.data.tokenizer, c.data.hf_tokenizer = "hf", bpe
  batch = next(iter(pipeline.make_iterator(c, "train", batch_size=2, repeat=False)))
  assert batch["tokens"].shape == (2, c.data.seq_len)
  c.data.tokenizer = "byte"
  with pytest.raises(ValueError, match="config.data.tokenizer: the shards in"):
    next(iter(pipeline.make_iterator(c, "train", batch_size=2, repeat=False)))
  with pytest.raises(ValueError, match="^--tokenizer: no tokenizer.json at"):
    prepare.open_tokenizer(f"hf:{tmp_path}/none")


def test_no_byte_fallback_warned_at_import_named_at_training(tmp_path):
  """A SentencePiece model without byte_fallback: `convert` warns at import (it cannot encode
  printable ASCII), and a corpus file it cannot encode is named as a file at training."""
  prefix = str(tmp_path / "nofb")
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(["abc def abc", "def ghi abc"] * 50), model_prefix=prefix,
      vocab_size=20, byte_fallback=False, minloglevel=2, hard_vocab_limit=False,
      pad_id=0, unk_id=1, bos_id=2, eos_id=3)
  tok = tokenizers.SentencePieceTokenizer(prefix + ".model")
  warning = workdir.check_coverage(tok, prefix + ".model")
  assert re.match(r"warning: --tokenizer: .*nofb.model cannot encode \d+ printable ASCII "
                  r"characters \('.*no byte fallback", warning), warning
  assert "\n" not in warning
  assert workdir.check_coverage(tokenizers.ByteTokenizer(), "bytes") == ""
  to_ids = corpus.Tokenize(tok, False)
  with pytest.raises(ValueError, match=r"^cannot encode text in src/x\.py: '\|' maps to the "
                     "unknown piece"):
    to_ids({"text": b"abc | def", "path": b"src/x.py"})
  np.testing.assert_array_equal(to_ids({"text": b"abc", "path": b"a.py"})[-1], tok.eos_id)
