"""Self-distilled training data: a model's own continuations of prompts, as token shards.

  python -m mtp_jax.decoding.distill --workdir W --source SPEC --out DIR [--prompt_len 64] \\
      [--max_new_tokens 192 --temperature 0 --top_p 1 --top_k 0 --num_samples 1] \\
      [--batch_size 16 --shards 4 --max_prompts N --heads K --seed 0]

Heads trained on the original corpus learn a distribution the model does not produce; Medusa-2
and EAGLE train them on the model's own generations. Every document of `--source` (any source of
`python -m mtp_jax.data.prepare`: tfds:, folder:, jsonl:, hf:, or `array_record:GLOB`, token
shards written with W's tokenizer) gives one prompt, its first --prompt_len tokens; head 1 of
W continues it (greedy, or sampled with --temperature / --top_p / --top_k, --num_samples times),
batched through the one-jit decoder (`decode.Decoder`), speculatively with heads 1..K (default
all: same greedy output, and speculative sampling is distributed as head 1's). Each record is
the prompt followed by the continuation up to, not including, EOS: the shards and metadata.json
have prepare's format, so `--config.data.corpus=array_record --config.data.files='DIR/tokens-*'`
trains on them (with W's tokenizer).

Prompts are split into --shards contiguous blocks; a finished shard is renamed into place with
its figures in DIR/done/, so a rerun with the same flags skips it (resumable); metadata.json is
written last. Row seeds are (seed + batch index, row): a rerun draws the same samples.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import json
import os
import sys
import time

import numpy as np

from mtp_jax import cli
from mtp_jax import workdir as workdir_lib
from mtp_jax.data import corpora
from mtp_jax.data import prepare
from mtp_jax.data.sources import open_source
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.decoding import sampling as sampling_lib

DONE = "done"
# Flags whose values define the output: a rerun into DIR must repeat them.
_DEFINING = ("workdir", "source", "prompt_len", "max_new_tokens", "temperature", "top_p",
             "top_k", "num_samples", "shards", "max_prompts", "heads", "seed", "text_key",
             "glob", "split")


class _ShardPrompts:
  """Token records of `array_record:GLOB` shards (prepare's format), as ids."""

  def __init__(self, pattern: str, loaded):
    import grain
    files = corpora.shard_files(pattern, "--source")
    meta = corpora.load_metadata(files, "--source")
    corpora.check_tokenizer(meta, loaded.config.data, loaded.tokenizer,
                            os.path.dirname(os.path.abspath(files[0])))
    self.dtype = np.dtype(meta["dtype"])
    self.source = grain.sources.ArrayRecordDataSource(files)

  def __len__(self) -> int:
    return len(self.source)

  def ids(self, i: int) -> np.ndarray:
    return np.frombuffer(self.source[i], self.dtype).astype(np.int32)


class _TextPrompts:
  def __init__(self, texts, tokenizer):
    self.texts, self.tokenizer = texts, tokenizer

  def __len__(self) -> int:
    return len(self.texts)

  def ids(self, i: int) -> np.ndarray | None:
    text = self.texts.text(i)
    return None if not text else np.asarray(self.tokenizer.encode(text), np.int32)


def open_prompts(spec: str, loaded, **source_kw):
  if spec.startswith("array_record:"):
    return _ShardPrompts(spec.partition(":")[2], loaded)
  return _TextPrompts(open_source(spec, **source_kw), loaded.tokenizer)


def check_flags(f: dict) -> None:
  """Checks that need no workdir: one line naming the flag."""
  for name in ("prompt_len", "max_new_tokens", "num_samples", "batch_size", "shards"):
    if f[name] < 1:
      raise ValueError(f"--{name}: must be >= 1, got {f[name]}")
  if f["max_prompts"] < 0:
    raise ValueError(f"--max_prompts: must be >= 0 (0: every document), got {f['max_prompts']}")
  sampling_lib.check(f["temperature"], f["top_k"], f["top_p"], f["seed"])
  if f["num_samples"] > 1 and f["temperature"] == 0:
    raise ValueError("--num_samples: > 1 needs --temperature > 0 (greedy continuations of a "
                     "prompt are all the same)")


def _check_out(out: str, flags_used: dict) -> None:
  """DIR is new, empty, or an unfinished distill run with the same flags (resumed)."""
  if not os.path.exists(out):
    return
  if not os.path.isdir(out):
    raise ValueError(f"--out: {out!r} exists and is not a folder")
  entries = set(os.listdir(out))
  if not entries:
    return
  if corpora.METADATA in entries:
    raise ValueError(f"--out: {out!r} already holds a finished corpus (metadata.json); "
                     "distill into a new folder")
  try:
    with open(os.path.join(out, DONE, "flags.json")) as fh:
      before = json.load(fh)
  except (OSError, ValueError):
    raise ValueError(f"--out: {out!r} exists, is not empty and is not an unfinished distill "
                     "run") from None
  for name, value in flags_used.items():
    if before.get(name) != value:
      raise ValueError(f"--out: {out!r} holds an unfinished run with --{name}="
                       f"{before.get(name)!r}; resume with the same flags or use a new folder")


class _Progress:
  def __init__(self, total: int):
    self.total, self.stream, self.start, self.last = total, sys.stderr, time.time(), 0.0

  def update(self, prompts: int, tokens: int, per_forward: float, force=False) -> None:
    now = time.time()
    if not force and now - self.last < 0.5:
      return
    self.last, secs = now, max(now - self.start, 1e-9)
    eta = (self.total - prompts) / max(prompts / secs, 1e-9)
    self.stream.write(f"\rdistill: {prompts:,}/{self.total:,} prompts {tokens / secs:,.0f} "
                      f"new tokens/s {per_forward:.2f} tokens/forward ETA {eta:,.0f}s   ")
    self.stream.flush()


def distill(workdir: str, source: str, out: str, *, prompt_len: int = 64,
            max_new_tokens: int = 192, temperature: float = 0.0, top_p: float = 1.0,
            top_k: int = 0, num_samples: int = 1, batch_size: int = 16, shards: int = 4,
            max_prompts: int = 0, heads: int = 0, seed: int = 0, text_key: str = "text",
            glob: str = "**/*", split: str = "train", tfds_data_dir: str = "",
            hf_cache_dir: str = "", progress: bool = True) -> dict:
  """Writes DIR/tokens-*.array_record and DIR/metadata.json; returns the metadata. Errors of
  the decoding library name its parameters (`main` names the flags)."""
  f = dict(locals())
  check_flags(f)
  out = os.path.expanduser(out)
  flags_used = {k: f[k] for k in _DEFINING}
  _check_out(out, flags_used)
  loaded = workdir_lib.load_workdir(workdir)
  args, tok = loaded.model.args, loaded.tokenizer
  k = heads or args.n_future
  decode_lib.check_heads(args, k)
  prompts_src = open_prompts(source, loaded, text_key=text_key, glob=glob, split=split,
                             tfds_data_dir=tfds_data_dir, hf_cache_dir=hf_cache_dir)
  n = len(prompts_src) if not max_prompts else min(max_prompts, len(prompts_src))
  if n == 0:
    raise ValueError(f"--source: {source!r} has no documents")
  decoder = decode_lib.Decoder(loaded.params, args, k=k, batch=batch_size,
                               prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                               sampling=temperature > 0)
  data = loaded.config.data
  tok_record = corpora.tokenizer_record(
      data.tokenizer, tok, data.spm_path if data.tokenizer == "sentencepiece" else "")
  dtype = prepare.token_dtype(tok)
  os.makedirs(os.path.join(out, DONE), exist_ok=True)
  with open(os.path.join(out, DONE, "flags.json"), "w") as fh:
    json.dump(flags_used, fh)
  bounds = np.linspace(0, n, shards + 1).astype(int)
  names = prepare.shard_names(shards)
  bar = _Progress(n) if progress else None
  done_prompts = new_tokens = cycles = gained = 0
  stats, skipped_docs = [], 0
  for s, name in enumerate(names):
    done_path = os.path.join(out, DONE, name + ".json")
    if os.path.isfile(done_path) and os.path.isfile(os.path.join(out, name)):
      with open(done_path) as fh:
        stats.append(json.load(fh))  # finished in an earlier run
      done_prompts += int(bounds[s + 1] - bounds[s])
      skipped_docs += stats[-1]["skipped"]
      continue
    docs = [prompts_src.ids(i) for i in range(bounds[s], bounds[s + 1])]
    rows = decode_lib.repeat([d[:prompt_len] for d in docs if d is not None and len(d)],
                             num_samples)
    shard_skipped = sum(1 for d in docs if d is None or not len(d))
    writer = prepare.Shard(out, name, dtype, atomic=True)
    for b0 in range(0, len(rows), batch_size):
      batch = rows[b0:b0 + batch_size]
      padded = batch + [batch[0]] * (batch_size - len(batch))  # a full batch; extras dropped
      r = decoder(padded, eos_id=tok.eos_id, pad_id=tok.pad_id, temperature=temperature,
                  top_k=top_k, top_p=top_p, seed=seed + int(bounds[s]) + b0)
      for i, prompt in enumerate(batch):
        cont = r.tokens[i, :r.lengths[i]]
        cont = cont[:np.argmax(cont == tok.eos_id)] if np.any(cont == tok.eos_id) else cont
        ids = np.concatenate([prompt, cont]).astype(dtype)
        writer.write(ids.tobytes())
        new_tokens += len(cont)
      cycles += int(r.cycles[:len(batch)].sum())  # as DecodeResult.tokens_per_forward
      gained += int((r.lengths[:len(batch)] - 1).sum())
      done_prompts += len(batch) / num_samples
      if bar:
        bar.update(int(done_prompts), new_tokens, gained / max(cycles, 1))
    stat = dict(writer.close(), skipped=shard_skipped)
    with open(done_path, "w") as fh:
      json.dump(stat, fh)
    stats.append(stat)
    skipped_docs += shard_skipped
  if bar:
    bar.update(n, new_tokens, gained / max(cycles, 1), force=True)
    bar.stream.write("\n")
  return prepare.write_metadata(out, {
      "source": source, "text_key": text_key, "split": split,
      "tokenizer": tok_record, "dtype": dtype.name,
      "documents": sum(x["records"] for x in stats), "skipped": skipped_docs,
      "tokens": sum(x["tokens"] for x in stats),
      "shards": [{k_: x[k_] for k_ in ("file", "records", "tokens", "bytes")} for x in stats],
      "distill": dict(flags_used, workdir=os.path.abspath(workdir), step=loaded.step,
                      heads=k, batch_size=batch_size),
  })


def _define(fv) -> None:
  from absl import flags
  flags.DEFINE_string("workdir", None, "the model: a training or imported workdir", flag_values=fv)
  flags.DEFINE_string("source", None, "prompts: tfds:NAME, folder:DIR, jsonl:FILE, "
                      "hf:NAME[:CONFIG], hf:DIR or array_record:GLOB", flag_values=fv)
  flags.DEFINE_string("out", None, "folder to write (new, empty, or a run to resume)",
                      flag_values=fv)
  flags.DEFINE_integer("prompt_len", 64, "prompt: a document's first tokens", flag_values=fv)
  flags.DEFINE_integer("max_new_tokens", 192, "tokens generated per prompt", flag_values=fv)
  flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampled", flag_values=fv)
  flags.DEFINE_float("top_p", 1.0, "nucleus sampling (1: off)", flag_values=fv)
  flags.DEFINE_integer("top_k", 0, "top-k sampling (0: off)", flag_values=fv)
  flags.DEFINE_integer("num_samples", 1, "continuations per prompt (sampled)", flag_values=fv)
  flags.DEFINE_integer("batch_size", 16, "rows per decoder call", flag_values=fv)
  flags.DEFINE_integer("shards", 4, "ArrayRecord files to write", flag_values=fv)
  flags.DEFINE_integer("max_prompts", 0, "first N documents only (0: all)", flag_values=fv)
  flags.DEFINE_integer("heads", 0, "draft with heads 1..K (0: all; 1: plain decoding)",
                       flag_values=fv)
  flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)
  flags.DEFINE_string("text_key", "text", "tfds / hf feature or JSON key", flag_values=fv)
  flags.DEFINE_string("glob", "**/*", "folder source: files to take", flag_values=fv)
  flags.DEFINE_string("split", "train", "tfds / hf source: split", flag_values=fv)
  flags.DEFINE_string("tfds_data_dir", "", "tfds source: data dir", flag_values=fv)
  flags.DEFINE_string("hf_cache_dir", "", "hf source: datasets cache", flag_values=fv)


def main(argv=None) -> int:
  fv = cli.parse(argv, _define, prog="python -m mtp_jax.decoding.distill", usage=__doc__.split(
      "\n\n")[1], required=("workdir", "source", "out"))
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  start = time.time()
  kw = {name: fv[name].value for name in _DEFINING + ("batch_size", "tfds_data_dir",
                                                      "hf_cache_dir")
        if name not in ("workdir", "source")}
  try:
    meta = distill(fv.workdir, fv.source, fv.out, **kw)
  except ValueError as e:  # the decoding library's errors, by flag (k: -> --heads:)
    raise ValueError(cli.flag_error(e)) from None
  print(f"wrote {meta['documents']:,} documents, {meta['tokens']:,} tokens in "
        f"{len(meta['shards'])} shards to {fv.out} ({time.time() - start:.1f}s); train the heads "
        f"on them with --config.data.corpus=array_record "
        f"--config.data.files='{fv.out}/tokens-*.array_record'")
  return 0


if __name__ == "__main__":
  cli.run(main)
