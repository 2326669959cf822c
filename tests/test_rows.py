"""Each process reads only its rows (data/rows.py): for P = 1, 2 and 4 simulated processes, the
rows read together are the global batch `pipeline.make_iterator` makes, bit for bit, disjoint,
and each process reads 1/P of the tokens."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mtp_jax import config as config_lib
from mtp_jax.config import validation
from mtp_jax.data import corpora, pipeline, prepare, rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 8
STEPS = 140  # past the first shuffle window (1024 rows = 128 batches) and several epochs


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
  """90 documents of 1 to ~150 bytes (rows are 32 tokens: many cut over rows), 3 shards."""
  root = tmp_path_factory.mktemp("rows")
  path = root / "docs.jsonl"
  docs = [f"doc {i}: " + "x = f(y)\n" * ((i * 7) % 17) for i in range(90)]
  path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  out = root / "shards"
  prepare.prepare(f"jsonl:{path}", "byte", str(out), shards=3, workers=0)
  return str(out)


def _config(out, **data):
  c = config_lib.load_file(os.path.join(ROOT, "configs/tiny.py"))
  c.data.update(dict(corpus="array_record", files=f"{out}/tokens-*.array_record", **data))
  c.train.batch_size = BATCH
  return validation.validate(c)


@pytest.mark.parametrize("data", [{}, {"val_files": "{out}/tokens-0000[12]-*.array_record"}])
def test_rows_of_p_processes_make_the_global_batch(shards, data):
  data = {k: v.format(out=shards) for k, v in data.items()}
  config = _config(shards, **data)
  assert rows.unsupported(config.data) == ""
  it = pipeline.make_iterator(config, "train")
  expected = [next(it) for _ in range(STEPS)]
  total = sum(int(np.count_nonzero(b["segment_ids"])) for b in expected)
  for P in (1, 2, 4):
    its = [rows.make_local_iterator(config, rows.even_spans(BATCH, p, P)) for p in range(P)]
    for step, want in enumerate(expected):
      got = [next(i) for i in its]
      for key in ("tokens", "segment_ids"):
        np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key],
                                      err_msg=f"P={P} step {step} {key}")
      read = [set(rows.rows_of_step(step, BATCH, i.spans)) for i in its]
      assert set().union(*read) == set(range(step * BATCH, (step + 1) * BATCH))
      assert sum(map(len, read)) == BATCH  # disjoint
    for i in its:
      assert i.tokens_read == pytest.approx(total / P, rel=0.1), (P, i.spans)


def test_state_is_the_batch_index_and_restores_on_any_process_count(shards):
  config = _config(shards)
  one = rows.make_local_iterator(config, rows.even_spans(BATCH, 0, 1))
  for _ in range(5):
    next(one)
  state = json.loads(json.dumps(one.get_state()))
  want = next(one)
  halves = [rows.make_local_iterator(config, rows.even_spans(BATCH, p, 2)) for p in range(2)]
  for h in halves:
    h.set_state(state)
  np.testing.assert_array_equal(np.concatenate([next(h)["tokens"] for h in halves]),
                                want["tokens"])


def test_corpora_that_pack_while_training_are_not_read_by_rows(shards, tmp_path):
  assert "whole_docs" in rows.unsupported(_config(shards, whole_docs=True).data)
  assert "worker_count" in rows.unsupported(_config(shards, worker_count=1).data)
  c = config_lib.load_file(os.path.join(ROOT, "configs/tiny.py"))
  assert "packed from its documents" in rows.unsupported(c.data)
  # Shards written before prepare wrote the lengths files: packed as before.
  old = tmp_path / "old"
  old.mkdir()
  for name in os.listdir(shards):
    if not name.endswith(corpora.LENGTHS_SUFFIX):
      (old / name).write_bytes(open(os.path.join(shards, name), "rb").read())
  assert "no record lengths" in rows.unsupported(_config(str(old)).data)


def test_a_resumed_run_keeps_the_iterator_its_checkpoint_was_saved_by(shards):
  """A checkpoint of the packing iterator (saved before the shards had lengths files) resumes
  packing, which restores it exactly; one read by rows, in a config that would pack, is one
  line naming config.data (the run would move the step aside as unusable otherwise)."""
  by_rows, packing = _config(shards), _config(shards, whole_docs=True)
  assert rows.unsupported_on_resume(by_rows.data, None) == ""
  assert rows.unsupported_on_resume(by_rows.data, (3, {"next_batch": 3})) == ""
  saved = (3, pipeline.make_iterator(by_rows, "train").get_state())
  assert "checkpoint step 3 holds the packing iterator's state" in rows.unsupported_on_resume(
      by_rows.data, saved)
  assert "whole_docs" in rows.unsupported_on_resume(packing.data, saved)
  with pytest.raises(ValueError, match=r"^config.data: checkpoint step 3 read the token shards "
                     r"by rows, but this run would pack the whole batch \(data.whole_docs"):
    rows.unsupported_on_resume(packing.data, (3, {"next_batch": 3}))


def test_even_spans_split_the_batch_in_process_order():
  assert [rows.even_spans(8, p, 4) for p in range(4)] == [[(0, 2)], [(2, 4)], [(4, 6)],
                                                          [(6, 8)]]
  with pytest.raises(ValueError):
    rows.even_spans(6, 0, 4)
