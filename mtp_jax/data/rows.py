"""Each process reads only its rows of the global batch: token shards, one global row index.

The train split of token shards (data.corpus = array_record, written by `data.prepare` with the
record lengths beside each shard) is, for `pipeline.make_iterator`, one endless stream: epoch e
visits the records in the order of a permutation seeded by (data.shuffle_seed, e), each with
eos (and bos) added, and the stream is cut into rows of data.seq_len, shuffled in windows of
`pipeline.SHUFFLE_WINDOW_ROWS` rows, and batched. All of it is a function of the record lengths:

  row r       tokens [r*S, (r+1)*S) of the stream; the record at stream offset t is found by a
              binary search over the cumulative lengths of t's epoch (computed once per epoch,
              O(records), as the shuffle itself does); each piece of a record is a segment
  batch b     rows w*W + index_shuffle(W-1-k, seed + w) for the positions n = w*W + k in
              [b*B, (b+1)*B): grain's window shuffle, which pops its shuffled window from the end

So a process builds the rows of step b its devices hold (`sharding.local_rows`) and reads the
records of those rows alone; the global batch of a step is the same whatever the number of
processes, bit for bit the one `make_iterator` gives (tests/test_rows.py checks both). The
iterator state is the step's batch index: it restores on any process count.

Not served here (the train loop keeps `make_iterator`, every process packing the whole batch):
corpora packed from text, data.whole_docs (a row's start depends on every row before it),
data.worker_count > 0, and shards without lengths files (written before prepare wrote them).
"""

from __future__ import annotations

import collections

import grain
from grain._src.python.experimental.index_shuffle.python import (  # grain's window shuffle
    index_shuffle_module as index_shuffle)
import jax
import numpy as np

from mtp_jax.data import corpora, corpus, pipeline, tokenizers

CACHE_TOKENS_PER_ROW = 4  # decoded records kept: up to this many rows' worth per window row


def unsupported(data_config) -> str:
  """Why the train split cannot be read by rows ('' when it can): the reason a run keeps
  packing the whole batch in every process."""
  d = data_config
  if d.corpus != "array_record":
    return f"data.corpus {d.corpus!r} is packed from its documents while training"
  if d.whole_docs:
    return "data.whole_docs packs each row after the one before it"
  if d.worker_count > 0:
    return "data.worker_count > 0 packs in worker processes"
  files = corpora.shard_files(d.files, "config.data.files")
  if corpora.record_lengths(files) is None:
    return "the shards have no record lengths beside them (prepare them again)"
  return ""


def unsupported_on_resume(data_config, saved: tuple[int, dict] | None) -> str:
  """`unsupported`, and for a resumed run whose checkpoint (`saved`: step and data state) the
  packing iterator wrote (a run before its shards had lengths files, or before this module):
  that it goes on packing, which restores it exactly. ValueError, naming config.data, for a
  checkpoint read by rows that this config would pack: its state is a batch index the packing
  iterator cannot take, and the run would otherwise move the step aside as unusable."""
  why = unsupported(data_config)
  if saved is None:
    return why
  step, state = saved
  by_rows = isinstance(state, dict) and set(state) == {"next_batch"}
  if by_rows and why:
    raise ValueError(
        f"config.data: checkpoint step {step} read the token shards by rows, but this run would "
        f"pack the whole batch ({why}); resume with data.corpus array_record, the shards' "
        "lengths files, data.whole_docs False and data.worker_count 0")
  if not by_rows and not why:
    return (f"checkpoint step {step} holds the packing iterator's state (saved by a run that "
            "packed the batch); packing restores it exactly")
  return why


def even_spans(batch_size: int, process_index: int, process_count: int) -> list[tuple[int, int]]:
  """The rows [(start, stop)] of a batch that process `process_index` of `process_count` holds
  when the batch is split evenly in process order (as `sharding.batch_sharding` splits it over
  processes that each hold the same number of devices)."""
  if batch_size % process_count:
    raise ValueError(f"batch_size {batch_size} must divide over {process_count} processes")
  n = batch_size // process_count
  return [(process_index * n, (process_index + 1) * n)]


class PackedRows:
  """Random access to the packed rows of the train stream (see the module docstring)."""

  def __init__(self, source, lengths, decode, *, seq_len: int, pad_id: int, seed: int,
               extra: int, window: int = pipeline.SHUFFLE_WINDOW_ROWS):
    self._source, self._decode = source, decode
    self._lens = np.asarray(lengths, np.int64) + extra  # eos (and bos) added to each record
    self._total = int(self._lens.sum())
    self._S, self._pad_id, self._seed, self._W = seq_len, pad_id, seed, window
    self._window_seed = (seed + 1) % 2**32
    self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
    self._cached_tokens = 0
    self._cache_budget = CACHE_TOKENS_PER_ROW * window * seq_len
    self.tokens_decoded = 0  # tokens of the records read (a record cut over rows is read once
    #                          while it stays in the cache)

  def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
    """(record order, cumulative end of each record in the epoch) of epoch e."""
    if e not in self._epochs:
      if len(self._epochs) >= 2:
        self._epochs.pop(min(self._epochs))
      order = np.random.default_rng([self._seed, e]).permutation(len(self._lens))
      self._epochs[e] = (order, np.cumsum(self._lens[order]))
    return self._epochs[e]

  def _record(self, i: int) -> np.ndarray:
    if i in self._cache:
      self._cache.move_to_end(i)
      return self._cache[i]
    ids = self._decode(self._source[i])
    self.tokens_decoded += len(ids)
    self._cache[i] = ids
    self._cached_tokens += len(ids)
    while self._cached_tokens > self._cache_budget and len(self._cache) > 1:
      self._cached_tokens -= len(self._cache.popitem(last=False)[1])
    return ids

  def packed_row(self, n: int) -> int:
    """The packed row at position n of the batched stream (after the window shuffle)."""
    w, k = divmod(n, self._W)
    return w * self._W + int(index_shuffle.index_shuffle(
        self._W - 1 - k, max_index=self._W - 1, seed=self._window_seed + w, rounds=4))

  def row(self, r: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32[S], segment_ids int32[S]) of packed row r."""
    S = self._S
    tokens_S = np.full(S, self._pad_id, np.int32)
    segment_ids_S = np.zeros(S, np.int32)
    t, filled, segment = r * S, 0, 0
    while filled < S:
      e, offset = divmod(t, self._total)
      order, ends = self._epoch(e)
      j = int(np.searchsorted(ends, offset, side="right"))
      i = int(order[j])
      into = offset - (int(ends[j]) - int(self._lens[i]))  # offset inside record i
      take = min(S - filled, int(ends[j]) - offset)
      segment += 1
      tokens_S[filled:filled + take] = self._record(i)[into:into + take]
      segment_ids_S[filled:filled + take] = segment
      filled += take
      t += take
    return tokens_S, segment_ids_S


def rows_of_step(step: int, batch_size: int, spans) -> list[int]:
  """Positions in the batched stream of the rows `spans` of the batch of `step`."""
  return [step * batch_size + j for a, b in spans for j in range(a, b)]


class LocalRowsIterator(grain.DatasetIterator):
  """Yields {"tokens", "segment_ids"}: int32[n, S], this process's rows (`spans`, in order) of
  each global batch; `tokens_read` counts the tokens put in them. State: the next batch index,
  the same in every process."""

  def __init__(self, rows: PackedRows, batch_size: int, spans):
    super().__init__()
    self._rows, self.batch_size, self.spans = rows, batch_size, [tuple(s) for s in spans]
    self._next = 0
    self.tokens_read = 0

  def __next__(self) -> dict[str, np.ndarray]:
    got = [self._rows.row(self._rows.packed_row(n))
           for n in rows_of_step(self._next, self.batch_size, self.spans)]
    self._next += 1
    batch = {"tokens": np.stack([g[0] for g in got]),
             "segment_ids": np.stack([g[1] for g in got])}
    self.tokens_read += int(np.count_nonzero(batch["segment_ids"]))
    return batch

  def get_state(self) -> dict:
    return {"next_batch": self._next}

  def set_state(self, state: dict) -> None:
    self._next = int(state["next_batch"])

  def __str__(self) -> str:
    return f"LocalRowsIterator(spans={self.spans})"


def make_local_iterator(config, spans) -> LocalRowsIterator:
  """This process's rows `spans` of every train batch (`unsupported` must be '')."""
  d = config.data
  kind = corpus.get(d)
  kind.check_split("train")
  tokenizer = tokenizers.get_tokenizer(d)
  source, decode = kind.documents(d, "train", tokenizer, False)
  lengths = corpora.record_lengths(corpora.shard_files(d.files, "config.data.files"))
  if not d.val_files:  # the train records of corpora.HeldOut: index mod k != 0, k as there
    lengths = lengths[np.arange(len(lengths)) % max(2, round(100 / d.val_percent)) != 0]
  assert len(lengths) == len(source), (len(lengths), len(source))
  rows = PackedRows(source, lengths, decode, seq_len=d.seq_len, pad_id=tokenizer.pad_id,
                    seed=d.shuffle_seed, extra=1 + decode.add_bos)
  return LocalRowsIterator(rows, config.train.batch_size, spans)


def put_local_rows(batch, sharding, spans, batch_size: int):
  """The global batch as arrays sharded by `sharding`, from this process's rows `spans` alone
  (what `LocalRowsIterator` yields): each device's index maps into them."""
  starts, at = {}, 0
  for a, b in spans:
    starts[a], at = at, at + b - a

  def put(x):
    def block(index):
      a, b, _ = index[0].indices(batch_size)
      span = max(s for s in starts if s <= a)
      return x[starts[span] + a - span:starts[span] + b - span]
    return jax.make_array_from_callback((batch_size,) + x.shape[1:], sharding, block)
  return jax.tree.map(put, batch)
