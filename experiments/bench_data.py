"""Input throughput on real corpora: `prepare` and the grain pipeline reading its shards.

    python experiments/bench_data.py [--folder DIR --glob '**/*.py'] [--workers 2] \
        [--batches 300] [--json experiments/results/bench_data.json]

Two corpora from the files under --folder (default: the top level of the running interpreter's
standard library, ~170 .py files, ~4.7 MB): `files`, one document per file (~28 KB each), and
`short_docs`, the same text cut at line ends into documents of about --doc_bytes (2,000: the
size of a C4 document), written as JSON lines. For each:
1. prepare: tokenizes with the byte tokenizer in --workers processes into --shards ArrayRecord
   files; tokens/s over the whole call (worker start-up included).
2. pipeline: `pipeline.make_iterator(config, split)` on those shards with the default config
   (batch 16 x 256, data.corpus = array_record), timing --batches batches after the first (which
   fills the 1024-row shuffle window); train (shuffled, window-shuffled rows) and validation.
   Per-document work dominates, so `short_docs` is the figure to quote.

The train step consumes train.batch_size * seq_len / step_seconds tokens/s; the figure to beat
is 20x that of the default config, read from experiments/results/bench_train.json (next-token,
same machine) when it is there. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import tempfile
import time

from experiments import common
from mtp_jax import config as config_lib
from mtp_jax.config import validation
from mtp_jax.data import pipeline
from mtp_jax.data import prepare
from mtp_jax.data import sources

HERE = os.path.dirname(os.path.abspath(__file__))


def write_short_docs(folder: str, glob: str, path: str, doc_bytes: int) -> None:
  """The folder's files cut at line ends into documents of about doc_bytes, as JSON lines."""
  with open(path, "w") as out:
    for name in sources._FolderTexts(folder, glob).files:
      with open(name, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
      doc, size = [], 0
      for line in lines:
        doc.append(line)
        size += len(line)
        if size >= doc_bytes:
          out.write(json.dumps({"text": "".join(doc)}) + "\n")
          doc, size = [], 0
      if doc:
        out.write(json.dumps({"text": "".join(doc)}) + "\n")


def bench_prepare(source: str, glob: str, out: str, shards: int, workers: int) -> dict:
  start = time.perf_counter()
  meta = prepare.prepare(source, "byte", out, shards=shards, workers=workers,
                         glob=glob, progress=False)
  secs = time.perf_counter() - start
  return {"documents": meta["documents"], "tokens": meta["tokens"], "seconds": secs,
          "workers": workers, "shards": shards, "tokens_per_sec": meta["tokens"] / secs,
          "docs_per_sec": meta["documents"] / secs}


def bench_pipeline(config, split: str, batches: int) -> dict:
  it = pipeline.make_iterator(config, split, repeat=True)
  start = time.perf_counter()
  next(it)
  first = time.perf_counter() - start
  start = time.perf_counter()
  tokens = 0
  for _ in range(batches):
    tokens += int((next(it)["segment_ids"] > 0).sum())
  secs = time.perf_counter() - start
  return {"batches": batches, "first_batch_seconds": first, "tokens": tokens,
          "seconds": secs, "tokens_per_sec": tokens / secs}


def train_step_tokens_per_sec() -> float | None:
  path = os.path.join(HERE, "results", "bench_train.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    rows = json.load(f)
  return next((r["tokens_per_sec"] for r in rows
               if r["kind"] == "parallel" and r["n_future"] == 1), None)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--folder", default=sysconfig.get_paths()["stdlib"])
  p.add_argument("--glob", default="*.py")
  p.add_argument("--shards", type=int, default=8)
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--batches", type=int, default=300)
  p.add_argument("--doc_bytes", type=int, default=2000)
  p.add_argument("--json", default="")
  args = p.parse_args(argv)

  c = config_lib.base_config()
  result = {"batch": c.train.batch_size, "seq_len": c.data.seq_len,
            "train_step_tokens_per_sec": train_step_tokens_per_sec()}
  with tempfile.TemporaryDirectory() as tmp:
    jsonl = os.path.join(tmp, "short_docs.jsonl")
    write_short_docs(args.folder, args.glob, jsonl, args.doc_bytes)
    for name, source in (("files", f"folder:{args.folder}"), ("short_docs", f"jsonl:{jsonl}")):
      out = os.path.join(tmp, name)
      r = result[name] = {"prepare": bench_prepare(source, args.glob, out, args.shards,
                                                   args.workers)}
      c.data.corpus, c.data.files = "array_record", os.path.join(out, "tokens-*.array_record")
      validation.validate(c)
      for split in ("train", "validation"):
        r[f"pipeline_{split}"] = bench_pipeline(c, split, args.batches)
      if result["train_step_tokens_per_sec"]:
        r["pipeline_train_over_train_step"] = (r["pipeline_train"]["tokens_per_sec"]
                                               / result["train_step_tokens_per_sec"])
  common.emit(result, args.json)


if __name__ == "__main__":
  main()
