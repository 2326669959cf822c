"""The grain input pipeline: documents -> tokens -> packed rows -> batches, checkpointable.

  source                                    the split's documents (ArrayRecord, random access:
                                            text records, or token records for array_record),
                                            opened by the data.corpus kind (corpus.py)
  -> shuffle(data.shuffle_seed), repeat     train: a new order every epoch, from the seed
  -> tokenize                               eos after every document, bos optional (token
                                            records: decoded, eos and bos added the same way)
  -> pack                                   concatenate, then cut into data.seq_len rows
                                            (data.whole_docs: a document that fits in a row
                                            is never cut)
  -> window shuffle                         train only: rows of one long file spread over batches
  -> batch                                  {"tokens": int32[B, S], "segment_ids": int32[B, S]},
                                            B = train.batch_size, the global batch

Packing is concatenate-then-split: a document longer than a row continues in the next one, and
every piece is its own segment (ids 1, 2, ... within a row, 0 for padding, whose tokens are
pad_id). Nothing is dropped and only the last row of a finite pass has padding. `segment_ids` is
what keeps attention and the loss inside a document: same id, same document. With
`data.whole_docs` a document that does not fit in the rest of a row starts the next one (the
rest is padding), so short examples (the synthetic tasks) are never seen without their start;
documents longer than a row are still cut.

The iterator is grain's `DatasetIterator`: `get_state()` is a small JSON-able dict (grain's orbax
handler stores it as JSON), and `set_state()` resumes on exactly the batch that was next.

Multi-host: every process builds this same pipeline and gets the same global batch, a
function of the step alone; `sharding.shard_batch` then hands each process's devices their own
rows of it. So 1, 2 or N processes train on identical batches (batches.log), and the iterator
state, the same on every process, restores on any process count (checkpoint.py). The price is
that each host packs the whole global batch, not 1/P of it: a few MB of int32 a step and the
tokenizer's time for its tokens. On token shards (data.corpus=array_record) the train loop
reads instead only its own rows of each batch (rows.py), the same rows bit for bit.
"""

from __future__ import annotations

import copy
import sys

from absl import flags
import grain
import numpy as np

from mtp_jax.data import corpus
from mtp_jax.data import tokenizers

# Rows shuffled together after packing, train split only. One stdlib file can fill hundreds of
# 256-token rows; a window of 1024 rows (1 MiB of int32 at S=256) keeps a batch from being one
# file, and costs one refill of the window when a checkpoint is restored.
SHUFFLE_WINDOW_ROWS = 1024


class ShuffleEpochs(grain.MapDataset):
  """Epoch e visits every document once, in the order of a permutation seeded by (seed, e).

  This is what grain's `shuffle().repeat()` does, but grain draws each index from `index_shuffle`,
  which costs ~1 ms per document below ~30 documents (22 ms at 2; 40 us at 1024): a small
  text_folder made packing a 1024-row shuffle window take seconds. A numpy permutation costs
  O(documents) once per epoch, and an index is still all the state there is.
  """

  def __init__(self, parent: grain.MapDataset, *, seed: int, num_epochs: int | None):
    super().__init__(parent)
    self._seed = seed
    self._n = len(parent)
    self._length = sys.maxsize if num_epochs is None else num_epochs * self._n
    self._epoch, self._order = -1, np.zeros(0, np.int64)

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, i = divmod(index, self._n)
    if epoch != self._epoch:
      self._order = np.random.default_rng([self._seed, epoch]).permutation(self._n)
      self._epoch = epoch
    return self._parent[int(self._order[i])]

  def __str__(self) -> str:
    return f"ShuffleEpochs(seed={self._seed})"


class _PackIterator(grain.DatasetIterator):
  """Concatenate-then-split over 1-D token arrays; yields {"tokens", "segment_ids"} rows.

  grain has `experimental.ConcatThenSplitIterDataset`, but in grain 0.2.18 its state holds tuples
  that JSON turns into lists, and a restore from JSON then drops a document (and it pads with 0,
  a real byte). This state is the parent's state before the document being cut plus an offset
  into it: JSON-native, and restoring re-reads one document.
  """

  def __init__(self, parent: grain.DatasetIterator, seq_len: int, pad_id: int,
               whole_docs: bool = False):
    super().__init__(parent)
    self._seq_len = seq_len
    self._pad_id = pad_id
    self._whole_docs = whole_docs
    self._doc_state = self._parent.get_state()  # parent state before `_doc` was read
    self._doc: np.ndarray | None = None
    self._offset = 0

  def __next__(self) -> dict[str, np.ndarray]:
    S = self._seq_len
    tokens_S = np.full(S, self._pad_id, np.int32)
    segment_ids_S = np.zeros(S, np.int32)
    filled = segment = 0
    while filled < S:
      if self._doc is None or self._offset == len(self._doc):
        state = self._parent.get_state()
        try:
          doc = next(self._parent)
        except StopIteration:
          break
        self._doc_state, self._doc, self._offset = state, doc, 0
      take = min(S - filled, len(self._doc) - self._offset)
      if self._whole_docs and filled and not self._offset and take < len(self._doc):
        break  # starts the next row: the state (this document, offset 0) says so
      if take:
        segment += 1
        tokens_S[filled:filled + take] = self._doc[self._offset:self._offset + take]
        segment_ids_S[filled:filled + take] = segment
        filled += take
        self._offset += take
    if not filled:
      raise StopIteration
    return {"tokens": tokens_S, "segment_ids": segment_ids_S}

  def get_state(self) -> dict:
    return {"parent": copy.deepcopy(self._doc_state), "has_doc": self._doc is not None,
            "offset": self._offset}

  def set_state(self, state: dict) -> None:
    self._doc_state = copy.deepcopy(state["parent"])
    self._parent.set_state(copy.deepcopy(state["parent"]))
    self._doc = next(self._parent) if state["has_doc"] else None
    self._offset = int(state["offset"])


class PackIterDataset(grain.IterDataset):
  """Packs a dataset of 1-D int32 token arrays into rows of `seq_len` (see `_PackIterator`)."""

  def __init__(self, parent: grain.IterDataset, *, seq_len: int, pad_id: int,
               whole_docs: bool = False):
    super().__init__(parent)
    self._seq_len = seq_len
    self._pad_id = pad_id
    self._whole_docs = whole_docs

  def __iter__(self) -> _PackIterator:
    return _PackIterator(self._parent.__iter__(), self._seq_len, self._pad_id, self._whole_docs)


class _StackRows:
  """Stacks rows into [B, S]; a short final batch gets padding rows, so shapes stay static."""

  def __init__(self, batch_size: int, pad_id: int):
    self.batch_size = batch_size
    self.pad_id = pad_id

  def __call__(self, rows) -> dict[str, np.ndarray]:
    n, S = len(rows), len(rows[0]["tokens"])
    tokens_BxS = np.full((self.batch_size, S), self.pad_id, np.int32)
    segment_ids_BxS = np.zeros((self.batch_size, S), np.int32)
    tokens_BxS[:n] = np.stack([r["tokens"] for r in rows])
    segment_ids_BxS[:n] = np.stack([r["segment_ids"] for r in rows])
    return {"tokens": tokens_BxS, "segment_ids": segment_ids_BxS}


def make_dataset(config, split: str, *, batch_size: int | None = None,
                 repeat: bool | None = None, add_bos: bool = False) -> grain.IterDataset:
  """The grain dataset behind `make_iterator` (same arguments); iterate it for a fresh iterator."""
  data = config.data
  kind = corpus.get(data)  # the one look-up of data.corpus: the kind opens the documents
  kind.check_split(split)
  batch_size = config.train.batch_size if batch_size is None else batch_size
  if batch_size < 1:
    raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
  if data.seq_len < 1:
    raise ValueError(f"config.data.seq_len: must be >= 1, got {data.seq_len}")

  tokenizer = tokenizers.get_tokenizer(data)
  source, to_ids = kind.documents(data, split, tokenizer, add_bos)
  docs = grain.MapDataset.source(source)
  if not len(docs):
    raise ValueError(f"config.data.corpus: the {split} split has no documents")
  train = split == "train"
  repeat = train if repeat is None else repeat
  if train:
    docs = ShuffleEpochs(docs, seed=data.shuffle_seed, num_epochs=None if repeat else 1)
  elif repeat:
    docs = docs.repeat()
  docs = docs.map(to_ids)
  # Arrays are local and tokenizing is cheap: reader threads would only fight over the GIL.
  ds = docs.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  ds = PackIterDataset(ds, seq_len=data.seq_len, pad_id=tokenizer.pad_id,
                       whole_docs=data.whole_docs)
  if train:
    ds = grain.experimental.WindowShuffleIterDataset(
        ds, window_size=SHUFFLE_WINDOW_ROWS, seed=(data.shuffle_seed + 1) % 2**32)
  ds = ds.batch(batch_size, batch_fn=_StackRows(batch_size, tokenizer.pad_id))
  if data.worker_count > 0:
    if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; a script may not parse them
      flags.FLAGS.mark_as_parsed()
    # Each worker packs its own slice of documents: deterministic for a given worker_count,
    # but changing worker_count changes the batches (and a saved state no longer applies).
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data.worker_count))
  return ds


def make_iterator(config, split: str, *, batch_size: int | None = None,
                  repeat: bool | None = None, add_bos: bool = False) -> grain.DatasetIterator:
  """Batches {"tokens": int32[B, S], "segment_ids": int32[B, S]} of `split`, S = data.seq_len.

  B = batch_size, else train.batch_size: the global batch, the same in every process. The train
  split is shuffled from data.shuffle_seed and repeats forever; validation
  is in file order and makes one pass (its last batch padded to B) unless `repeat`. Deterministic:
  the same config gives the same batches. Builds the dataset on first use.
  """
  return iter(make_dataset(config, split, batch_size=batch_size, repeat=repeat,
                           add_bos=add_bos))
