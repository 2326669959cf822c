"""What XLA's C++ code logs while one program compiles (the SPMD partitioner's warnings), read
from file descriptor 2, where absl logging writes past Python's sys.stderr.

tests/sharding_check.py compiles its sharded train step through `compile_logged` and asserts
that the log has no `REMAT` line; `remat_control` shows that such a line, when XLA writes one,
does reach the log here (so an empty log is not the capture failing).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

# XLA replicates a whole array on every device and slices it again when it finds no cheaper
# way between two shardings; it says so with this line (spmd_partitioner.cc).
REMAT = "Involuntary full rematerialization"


@contextlib.contextmanager
def _fd2_to(path: str):
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(path, "wb") as f:
      os.dup2(f.fileno(), 2)
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def compile_logged(lowered):
  """(compiled, the lines XLA logged while compiling `lowered`). A program read from the
  persistent compilation cache is not partitioned again and logs nothing, so the cache must be
  off in this process (JAX_ENABLE_COMPILATION_CACHE=false before jax starts; jax decides once)."""
  if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:
    raise RuntimeError("compile_logged: the persistent compilation cache is on; a cached "
                       "program would log nothing")
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "fd2.log")
    with _fd2_to(path):
      compiled = lowered.compile()
    with open(path, encoding="utf-8", errors="replace") as f:
      log = f.read()
  sys.stderr.write(log)  # still shown, as it would be without the capture
  return compiled, log.splitlines()


def remat_lines(lines) -> list[str]:
  return [line[:400] for line in lines if REMAT in line]


def remat_control(mesh) -> list[str]:
  """The REMAT lines of a lookup in an embedding table stored as the params are, (vocab over
  `tensor`, embed over `fsdp`), its rows wanted over the batch axes: XLA warns for it on a
  (data, fsdp) mesh, as it did for the train step before model.embed_lookup."""
  def ns(*spec):
    return NamedSharding(mesh, P(*spec))
  lookup = jax.jit(lambda t, i: jnp.take(t, i, axis=0),
                   in_shardings=(ns("tensor", "fsdp"), ns(("data", "fsdp"))),
                   out_shardings=ns(("data", "fsdp")))
  lowered = lookup.lower(jax.ShapeDtypeStruct((128, 32), jnp.float32),
                         jax.ShapeDtypeStruct((8, 16), jnp.int32))
  return remat_lines(compile_logged(lowered)[1])
