"""What k="auto" / tree="auto" measured, kept on disk (`session.Session(disk=...)`), so that a
later process on the same machine and model decides without probing: a JSON file per key under
$MTP_JAX_CACHE/timings (default ~/.cache/mtp_jax/timings; MTP_JAX_CACHE=off: no disk cache).

Two kinds of entry (docs/decoding.md, "Deciding in a blink"):
- "forward": seconds of one window's cached forward (`costmodel.forward_times`), keyed by the
  machine (backend, device kind, CPU model and count, jax version), the model's shape (a hash
  of its ModelArgs), batch, context and the window (the candidate);
- "probe": a probe's acceptance histogram per row and its loop's seconds per cycle, keyed as
  above plus the params' fingerprint (other weights accept differently), batch, prompt bucket
  (the prompt width rounded up to a multiple of 32), max_new_tokens, the sampling settings (seed
  aside) and the probed window. Its acceptance is that of the first call's prompts of the shape.

A file that cannot be read or does not hold its key is ignored with a warning (and rewritten
by the next measurement); a failed write is a warning too, never an error of the decode."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import tempfile

import jax
import numpy as np

from mtp_jax import hostinfo

log = logging.getLogger(__name__)

ENV = "MTP_JAX_CACHE"  # the cache's root; "off" (or "", "0", "none"): no disk cache
DEFAULT_ROOT = os.path.join("~", ".cache", "mtp_jax")


def default() -> DiskCache | None:
  """The cache at $MTP_JAX_CACHE/timings (or ~/.cache/mtp_jax/timings); None where it is off."""
  root = os.environ.get(ENV, DEFAULT_ROOT)
  if root.strip().lower() in ("", "off", "0", "none"):
    return None
  return DiskCache(os.path.join(os.path.expanduser(root), "timings"))


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def machine() -> dict:
  """What a timing depends on beyond the model: backend, device kind (CPU: its model name and
  count), jax's version."""
  dev = jax.devices()[0]
  out = {"backend": jax.default_backend(), "device_kind": dev.device_kind,
         "devices": jax.device_count(), "jax": jax.__version__}
  if out["backend"] == "cpu":
    out.update(cpu=hostinfo.cpu_model_name(), cpu_count=os.cpu_count())
  return out


def model_shape(args) -> str:
  """A hash of the model's arguments (ModelArgs): its shape, head kind, dtypes."""
  return _digest(dataclasses.asdict(args) if dataclasses.is_dataclass(args) else args)[:16]


def fingerprint(params, samples: int = 64) -> str:
  """A hash of the params' leaves: their paths, shapes, dtypes and `samples` values of each,
  evenly strided (host arrays and CPU ones read directly; others through one jitted sum)."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_leaves_with_path(params)
  host = jax.default_backend() == "cpu" or all(isinstance(x, np.ndarray) for _, x in leaves)
  if not host:
    sums = jax.device_get(jax.jit(lambda p: jax.tree.map(
        lambda x: (x.astype(np.float32).sum(), (x.astype(np.float32) ** 2).sum()), p))(params))
  for i, (path, x) in enumerate(leaves):
    h.update(f"{jax.tree_util.keystr(path)} {np.shape(x)} {x.dtype}".encode())
    if host:
      flat = np.asarray(x).reshape(-1)
      h.update(np.ascontiguousarray(flat[::max(1, flat.size // samples)][:samples]).tobytes())
    else:
      h.update(np.asarray(jax.tree.leaves(sums)[2 * i:2 * i + 2], np.float64).tobytes())
  return h.hexdigest()[:16]


def prompt_bucket(width: int) -> int:
  """The prompt width rounded up to a multiple of 32: one cache entry per bucket."""
  return max(32, -(-int(width) // 32) * 32)


class DiskCache:
  """JSON files {"key": ..., "value": ...} in `root`, named by a hash of the key."""

  def __init__(self, root: str):
    self.root = root

  def path(self, key: dict) -> str:
    return os.path.join(self.root, _digest(key)[:32] + ".json")

  def get(self, key: dict):
    """The value stored under `key`, or None (absent; unreadable or another key's: a warning)."""
    path = self.path(key)
    if not os.path.exists(path):
      return None
    try:
      with open(path) as f:
        entry = json.load(f)
      if entry["key"] != json.loads(json.dumps(key, default=str)):
        raise ValueError("it holds another key")
      return entry["value"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      log.warning("timing cache: ignoring %s (%s: %s); measuring again", path,
                  type(e).__name__, e)
      return None

  def put(self, key: dict, value) -> None:
    """Writes `value` under `key` (atomically: a temporary file renamed over the entry)."""
    try:
      os.makedirs(self.root, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
      with os.fdopen(fd, "w") as f:
        json.dump({"key": key, "value": value}, f, default=str)
      os.replace(tmp, self.path(key))
    except (OSError, TypeError, ValueError) as e:
      log.warning("timing cache: could not write to %s (%s)", self.root, e)


class Bounded:
  """At most `size` entries, the least recently used dropped first: what a `session.Session` keeps
  in memory (its choices, its forward times per shape)."""

  def __init__(self, size: int):
    self.size, self._d = size, collections.OrderedDict()

  def get(self, key, make):
    if key not in self._d:
      self._d[key] = make()
      if len(self._d) > self.size:
        self._d.popitem(last=False)
    self._d.move_to_end(key)
    return self._d[key]

  def __len__(self) -> int:
    return len(self._d)
