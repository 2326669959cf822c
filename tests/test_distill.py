"""`python -m mtp_jax.decoding.distill`: a tiny model's own continuations of prompts from a JSONL
source, as prepare-format token shards (the records are the prompts followed by plain greedy
decoding's output), resumed shard by shard, read back as a source, trained on; one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import grain
import numpy as np
import pytest

from mtp_jax.config import validation
from mtp_jax import convert, train
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.data import corpora, tokenizers
from mtp_jax.decoding import distill

DOCS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n",
        "class A:\n    pass\n", "x = [i * i for i in range(10)]\n", "while True:\n    break\n",
        "for k in d:\n    print(k, d[k])\n", "# a comment line\n", "y = {'a': 1, 'b': 2}\n"]
FLAGS = ["--prompt_len", "6", "--max_new_tokens", "10", "--batch_size", "3", "--shards", "3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  from conftest import tiny_config, tiny_model
  root = tmp_path_factory.mktemp("distill")
  c = tiny_config("parallel", 3)
  c.model.vocab_size = 259  # the byte tokenizer's
  model, params = tiny_model(c)
  wd = str(root / "wd")
  convert.write_workdir(wd, c, params)
  src = root / "docs.jsonl"
  src.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
  return {"root": root, "wd": wd, "src": f"jsonl:{src}", "config": c, "model": model,
          "params": params}


def _records(folder):
  files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".array_record"))
  src = grain.sources.ArrayRecordDataSource(files)
  return [np.frombuffer(src[i], np.uint16).astype(np.int32) for i in range(len(src))]


@pytest.mark.slow
def test_distill_writes_greedy_continuations_resumes_and_trains(tiny, capsys):
  out = str(tiny["root"] / "out")
  argv = ["--workdir", tiny["wd"], "--source", tiny["src"], "--out", out] + FLAGS
  assert distill.main(argv) == 0
  assert "distill: 8/8 prompts" in capsys.readouterr().err  # the progress line
  meta = json.load(open(os.path.join(out, corpora.METADATA)))
  assert meta["format"] == corpora.FORMAT and meta["documents"] == 8
  assert [s["records"] for s in meta["shards"]] == [2, 3, 3]  # contiguous blocks of prompts
  assert meta["distill"]["heads"] == 3 and meta["distill"]["max_new_tokens"] == 10

  tok = tokenizers.ByteTokenizer()
  prompts = [tok.encode(t)[:6] for t in DOCS]
  ref = decode_lib.plain(tiny["params"], tiny["model"].args, prompts, max_new_tokens=10,
                          eos_id=tok.eos_id, pad_id=tok.pad_id)
  got = _records(out)
  assert len(got) == 8
  for b, rec in enumerate(got):  # shard order = prompt order; speculative output = greedy's
    cont = ref.tokens[b, :ref.lengths[b]]
    cont = cont[:np.argmax(cont == tok.eos_id)] if np.any(cont == tok.eos_id) else cont
    np.testing.assert_array_equal(rec, np.concatenate([prompts[b], cont]), err_msg=str(b))

  # Resume: shard 1 lost (and the metadata): only shard 1 is decoded again, to the same bytes.
  shard1 = os.path.join(out, meta["shards"][1]["file"])
  before = open(shard1, "rb").read()
  mtime0 = os.path.getmtime(os.path.join(out, meta["shards"][0]["file"]))
  os.remove(shard1)
  os.remove(os.path.join(out, corpora.METADATA))
  assert distill.main(argv) == 0
  assert open(shard1, "rb").read() == before
  assert os.path.getmtime(os.path.join(out, meta["shards"][0]["file"])) == mtime0
  assert json.load(open(os.path.join(out, corpora.METADATA)))["shards"] == meta["shards"]

  # The shards are a prompt source (array_record:GLOB) and a training corpus.
  again = str(tiny["root"] / "again")
  assert distill.main(["--workdir", tiny["wd"], "--source", f"array_record:{out}/tokens-*",
                       "--out", again, "--max_prompts", "3"] + FLAGS) == 0
  assert [r[:6].tolist() for r in _records(again)] == [p.tolist() for p in prompts[:3]]
  c = tiny["config"].copy_and_resolve_references()
  c.data.corpus, c.data.files, c.data.val_percent = "array_record", f"{out}/tokens-*", 20
  c.train.steps, c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 2, 1, 2, 2
  c.train.eval_batches, c.train.async_checkpoints = 1, False
  c.train.init_from, c.optim.trainable = tiny["wd"], "heads"
  summary = train.train(validation.resolve(c), str(tiny["root"] / "run"))
  assert summary["step"] == 2


def test_distill_errors_are_one_line(tiny, capsys):
  out = str(tiny["root"] / "bad")
  base = ["--workdir", tiny["wd"], "--source", tiny["src"], "--out", out]
  for extra, match in (
      (["--num_samples", "2"], "--num_samples: > 1 needs --temperature > 0"),
      (["--top_p", "1.5"], "top_p"),
      (["--shards", "0"], "--shards: must be >= 1"),
      (["--max_new_tokens", "40"], "exceeds the model's max_len (32)")):
    with pytest.raises(ValueError, match=re.escape(match)):
      distill.main(base + extra)
    assert not os.path.exists(out)
  with pytest.raises(ValueError, match=r"^--source: got 'nope:x'"):
    distill.main(["--workdir", tiny["wd"], "--source", "nope:x", "--out", out])
  os.makedirs(out, exist_ok=True)
  open(os.path.join(out, "other.txt"), "w").close()
  with pytest.raises(ValueError, match="is not empty and is not an unfinished distill run"):
    distill.main(base)
  assert sorted(os.listdir(out)) == ["other.txt"]


@pytest.mark.slow
def test_distill_command_line(tmp_path):
  """The real entry point: --help exits 0; a bad flag is one `error:` line and exit status 2,
  before any workdir is read or anything written."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = lambda *argv: subprocess.run([sys.executable, "-m", "mtp_jax.decoding.distill", *argv],
                                     capture_output=True, text=True, timeout=300,
                                     env=dict(os.environ, PYTHONPATH=root))
  p = run("--help")
  assert p.returncode == 0 and "--max_new_tokens" in p.stdout, p.stdout + p.stderr
  out = str(tmp_path / "o")
  p = run("--workdir", str(tmp_path / "none"), "--source", "jsonl:x", "--out", out,
          "--temperature", "0", "--num_samples", "2")
  assert p.returncode == 2 and p.stderr.strip().splitlines() == [
      "error: --num_samples: > 1 needs --temperature > 0 (greedy continuations of a prompt "
      "are all the same)"], p.stderr
  assert not os.path.exists(out)
