"""params_sha256 does not depend on where the params lie: the same values on one device, on the
host, and sharded several ways over 8 simulated CPU devices (in a process of its own: the device
count is fixed when jax starts) hash alike; the re-layout it hashes from holds each block on one
device, never the whole leaf on every device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np

from mtp_jax import steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def params() -> dict:
  """Leaves of 1 to 5 blocks and under one, float32 and bfloat16, sizes that do not divide."""
  rng = np.random.default_rng(0)
  return {"a": rng.standard_normal((300, 257)).astype(np.float32),
          "b": {"w": rng.standard_normal((8, 64, 130)).astype(jax.numpy.bfloat16)},
          "bias": np.arange(7, dtype=np.float32),
          "emb": rng.standard_normal((1024, 96)).astype(np.float32),
          "big": rng.standard_normal((1024, 640)).astype(np.float32)}


# Each leaf's PartitionSpec over the mesh (x=2, y=4), in three placements of the same values.
PLACEMENTS = {
    "rows": {"a": ("x", None), "b/w": ("y", None, None), "bias": (), "emb": (("x", "y"), None),
             "big": (("x", "y"), None)},
    "columns": {"a": (None, None), "b/w": (None, "y", "x"), "bias": (), "emb": (None, ("x", "y")),
                "big": (None, ("x", "y"))},
    "mixed": {"a": ("x", None), "b/w": ("x", None, None), "bias": (), "emb": ("y", "x"),
              "big": ("y", "x")},
}

CHILD = r"""
import json, math, re, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
from test_params_hash import PLACEMENTS, params
from mtp_jax import steps

assert jax.device_count() == 8
mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("x", "y"))
out = {}
for name, specs in PLACEMENTS.items():
  placed = jax.tree_util.tree_map_with_path(
      lambda path, x: jax.device_put(x, NamedSharding(mesh, P(*specs[
          jax.tree_util.keystr(path, simple=True, separator="/")]))), params())
  out[name] = steps.params_sha256(placed)
  relaid = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(placed)[0]:
    r, per_device = steps.relaid_for_hashing(leaf)
    hlo = steps._relayout(r.size - leaf.size, r.sharding).lower(leaf).compile().as_text()
    moved = [sum(math.prod(int(d) for d in dims.split(",") if d)
                 for dims in re.findall(r"\[([\d,]*)\]", m.group(1)))
             for m in re.finditer(r"= (.*?) (?:all-gather|all-to-all|collective-permute|all-reduce)"
                                  r"(?:-start)?\(", hlo)]
    relaid[jax.tree_util.keystr(path, simple=True, separator="/")] = {
        "replicated": r.sharding.is_fully_replicated, "devices": len(r.sharding.device_set),
        "shard_sizes": sorted({s.data.size for s in r.addressable_shards}),
        "per_device": per_device, "size": leaf.size, "largest_collective": max(moved, default=0)}
  out[name + "/relaid"] = relaid
print("RESULT " + json.dumps(out))
"""


def test_the_hash_is_the_same_on_one_device_and_sharded_over_eight():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
             + " --xla_force_host_platform_device_count=8")
  p = subprocess.run([sys.executable, "-c", CHILD, os.path.join(ROOT, "tests")], env=env,
                     capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert p.returncode == 0, p.stderr[-3000:]
  got = json.loads(next(line for line in p.stdout.splitlines()
                        if line.startswith("RESULT "))[len("RESULT "):])
  one_device = steps.params_sha256(jax.device_put(params(), jax.devices()[0]))
  assert steps.params_sha256(params()) == one_device  # numpy leaves: hashed on the host
  assert {got[name] for name in PLACEMENTS} == {one_device}
  for name in PLACEMENTS:
    for leaf, r in got[name + "/relaid"].items():
      assert not r["replicated"] and r["devices"] == 8, (name, leaf, r)
      # Every device holds its own whole blocks.
      assert r["shard_sizes"] == [r["per_device"] * steps.HASH_BLOCK], (name, leaf, r)
      # A leaf of a block or more per device is moved in parts (all-to-all, permutes, a gather
      # over one mesh axis), never gathered whole onto a device. (XLA's partitioner does gather
      # a smaller one whole, at most 8 x HASH_BLOCK elements here; one every device holds whole
      # is hashed from a process's own copy, with no re-layout.)
      if r["size"] >= 8 * steps.HASH_BLOCK:
        assert r["largest_collective"] < r["size"], (name, leaf, r)


def test_the_hash_sees_every_element_shape_and_dtype():
  base = params()
  h = steps.params_sha256(base)
  for change in ("value", "shape", "dtype"):
    p = params()
    if change == "value":
      p["big"][1023, 639] += 1  # the last element of the last block
    elif change == "shape":
      p["big"] = p["big"].reshape(640, 1024)
    else:
      p["bias"] = p["bias"].view(np.int32)  # the same bytes
    assert steps.params_sha256(p) != h, change
