"""The training data of experiments/smollm2_heads.py and the demo (experiments/smollm2_demo.py):
windows of standard-library code in the model's tokens, the model's own greedy continuations of
them (self-distilled windows), and the frozen trunk's output for every window, each cached as a
.npy file so that a rerun and every run of an experiment read it instead of computing it; the
draft vocabulary of those windows, and a seed's initialisation of the new heads."""

from __future__ import annotations

import os
import sysconfig
import time
import zlib

import jax
import numpy as np

from mtp_jax.decoding import decode as decode_lib
from mtp_jax.model import trunk_states

def stdlib_windows(tok, n: int, S: int) -> np.ndarray:
  """n windows of S tokens from the standard library's .py files (a fixed shuffled file order;
  each file + eos, concatenated)."""
  root = sysconfig.get_paths()["stdlib"]
  files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                 if f.endswith(".py") and "test" not in d.split(os.sep))
  files.sort(key=lambda f: zlib.crc32(os.path.relpath(f, root).encode()))
  out, buf = [], []
  for f in files:
    with open(f, encoding="utf-8", errors="replace") as fh:
      buf.extend(tok.encode(fh.read()[:40000]).tolist() + [tok.eos_id])
    while len(buf) >= S and len(out) < n:
      out.append(buf[:S])
      buf = buf[S:]
    if len(out) >= n:
      break
  return np.asarray(out, np.int32)


def distilled_windows(loaded, windows: np.ndarray, P: int, batch: int = 16) -> np.ndarray:
  """Each window's first P tokens, then the model's own greedy continuation to the same length."""
  S = windows.shape[1]
  dec = decode_lib.Decoder(loaded.params, loaded.model.args, k=1, batch=batch, prompt_len=P,
                           max_new_tokens=S - P)
  out = []
  for i in range(0, len(windows), batch):
    rows = [w[:P] for w in windows[i:i + batch]]
    r = dec(rows + rows[:1] * (batch - len(rows)), eos_id=-1, pad_id=loaded.tokenizer.pad_id)
    out += [np.concatenate([rows[b], r.tokens[b, :S - P]]) for b in range(len(rows))]
    print(f"  distilled {min(i + batch, len(windows))}/{len(windows)} windows", flush=True)
  return np.asarray(out, np.int32)


def cached(path: str, make):
  if os.path.isfile(path):
    return np.load(path, mmap_mode="r")
  x = make()
  np.save(path + ".tmp.npy", x)
  os.replace(path + ".tmp.npy", path)
  return np.load(path, mmap_mode="r")


def states_of(loaded, windows: np.ndarray, batch: int = 8) -> np.ndarray:
  """The frozen trunk's output for every window (float32 [n, S, D]), `batch` windows at a time."""
  f = jax.jit(lambda p, t: trunk_states(p, loaded.model.args, t))
  out, t0 = [], time.perf_counter()
  for i in range(0, len(windows), batch):
    part = windows[i:i + batch]
    pad = np.concatenate([part, part[:1].repeat(batch - len(part), 0)]) if len(part) < batch \
        else part
    out.append(np.asarray(f(loaded.params, pad))[:len(part)])
  rate = windows.size / (time.perf_counter() - t0)
  print(f"  trunk states of {len(windows)} windows: {rate:.0f} tokens/s", flush=True)
  return np.concatenate(out)


def perturbed(params, margs, seed: int):
  """Heads 2..n's leaves plus noise of 1% of each leaf's scale (1e-4 where it is zero): the
  seed's own initialisation around the copies of head 1. Head 1's own slots stay as they are."""
  from mtp_jax import heads as heads_lib
  kind = heads_lib.KINDS[margs.head_kind]
  slots = {}
  for j in range(2, margs.n_future + 1):
    for path, index in kind.head_params(j):
      slots.setdefault(tuple(path), []).append(index)
  rng = np.random.default_rng(1000 + seed)
  heads = jax.tree_util.tree_map_with_path(lambda p, x: np.asarray(x), params["heads"])

  def noise(path, x):
    names = ("heads",) + tuple(getattr(k, "key", str(k)) for k in path)
    idx = slots.get(names[:2])
    if idx is None:
      return x
    x = np.array(x)
    for i in idx:
      scale = float(np.std(x[i])) * 0.01 or 1e-4
      x[i] = x[i] + rng.standard_normal(x[i].shape).astype(x.dtype) * scale
    return x

  return {**params, "heads": jax.tree_util.tree_map_with_path(noise, heads)}


def draft_ids(windows: np.ndarray, V: int, vprime: int):
  if not vprime or vprime >= V:
    return None
  counts = np.bincount(np.asarray(windows).reshape(-1), minlength=V)
  return np.sort(np.argsort(-counts, kind="stable")[:vprime]).astype(np.int32)
