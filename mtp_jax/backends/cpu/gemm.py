"""float32 matmuls on XLA:CPU through Intel MKL's sgemm instead of XLA's own GEMM.

XLA:CPU runs a train step's GEMMs, the weight gradients worst, slower than MKL does
(docs/cpu_speed.md has the figures per machine). This calls MKL's sgemm from an XLA FFI handler
(csrc/cpu_gemm.cc) on XLA's own buffers, each GEMM split over XLA's own threads. The MKL is the
one inside PyTorch's x86-64 CPU wheels (libtorch_cpu.so exports SGEMM and
MKL_Set_Num_Threads_Local): found where torch is installed, loaded without importing torch. The
handler is compiled once per source and jaxlib with the C++ compiler at hand (`$CXX`, else c++)
into ~/.cache/mtp_jax.

    gemm.available()          # built and registered here? (unavailable_reason() says why not)
    y = gemm.matmul(x_MxK, w_KxN)            # differentiable: its VJP is two more sgemms
    nn.Dense(..., dot_general=gemm.dot_general)   # flax: 2-D-able float32 contractions

`model.cpu_matmul` picks it (`backends.cpu.ops.dot_general`, the only importer in the library):
"auto" takes it for programs compiled for one CPU device of an Intel CPU where it is available,
and only for float32 products of MIN_ROWS rows or more (a decoding step's few rows stay with
XLA). Same maths as XLA's dot up to float32 summation order.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mtp_jax.backends.cpu import cpuinfo

TARGET = "mtp_jax_sgemm"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "cpu_gemm.cc")
MIN_ROWS = 256  # dot_general: fewer rows than this (decoding's batch x window) stay with XLA


def _mkl():
  """(library, why not): PyTorch's libtorch_cpu.so where torch is installed and exports MKL's
  SGEMM and MKL_Set_Num_Threads_Local, else None and the reason."""
  spec = importlib.util.find_spec("torch")
  if spec is None or not spec.origin:
    return None, "needs PyTorch's CPU wheel for its MKL (torch is not installed)"
  path = os.path.join(os.path.dirname(spec.origin), "lib", "libtorch_cpu.so")
  try:
    lib = ctypes.CDLL(path)
  except OSError as e:
    return None, f"could not load {path}: {e}"
  if not all(hasattr(lib, n) for n in ("SGEMM", "MKL_Set_Num_Threads_Local")):
    return None, f"{path} exports no MKL sgemm (a torch build without MKL)"
  return lib, None


def _cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "mtp_jax")


def _build() -> str:
  """The handler's shared library, compiled unless this source and jaxlib already have one."""
  import jaxlib
  with open(SOURCE, "rb") as f:
    key = hashlib.sha256(f.read() + jaxlib.__version__.encode()).hexdigest()[:16]
  folder = _cache_dir()
  out = os.path.join(folder, f"cpu_gemm_{key}.so")
  if os.path.exists(out):
    return out
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
  os.close(fd)
  try:
    subprocess.run([os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
                    f"-I{jax.ffi.include_dir()}", SOURCE, "-o", tmp],
                   check=True, capture_output=True, text=True)
    os.replace(tmp, out)  # atomic: processes building at once each end with a whole file
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return out


@functools.cache
def unavailable_reason() -> str | None:
  """None once the handler is built, loaded and registered for XLA:CPU; else why not."""
  if sys.platform != "linux" or platform.machine() != "x86_64":
    return f"only on Linux x86-64 (this is {sys.platform} {platform.machine()})"
  mkl, why = _mkl()
  if mkl is None:
    return why
  try:
    path = _build()
  except (OSError, subprocess.CalledProcessError) as e:
    detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
    return f"could not compile {SOURCE}: {detail[-1] if detail else e}"
  lib = ctypes.CDLL(path)
  lib.mtp_set_sgemm(ctypes.cast(mkl.SGEMM, ctypes.c_void_p),
                    ctypes.cast(mkl.MKL_Set_Num_Threads_Local, ctypes.c_void_p))
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.MtpSgemm), platform="cpu")
  return None


def available() -> bool:
  return unavailable_reason() is None


def intel_cpu() -> bool:
  """Whether this is an Intel CPU (/proc/cpuinfo): where "auto" takes MKL, the only vendor it
  was measured faster on."""
  return cpuinfo.cpu_ids()[0] == "GenuineIntel"


def _sgemm(a, b, trans_a: bool = False, trans_b: bool = False):
  """op(a) @ op(b) for float32 [M, K] x [K, N] (op: transposed where asked), by the handler."""
  m = a.shape[-1] if trans_a else a.shape[-2]
  n = b.shape[-2] if trans_b else b.shape[-1]
  out = jax.ShapeDtypeStruct((m, n), jnp.float32)
  # Under vmap both operands get the batch axis (broadcast where unbatched): a loop of GEMMs.
  return jax.ffi.ffi_call(TARGET, out, vmap_method="broadcast_all")(
      a, b, trans_a=trans_a, trans_b=trans_b)


@jax.custom_vjp
def matmul(x_MxK, w_KxN):
  """x @ w for float32 2-D operands by MKL (`available()` must hold)."""
  return _sgemm(x_MxK, w_KxN)


def _matmul_fwd(x_MxK, w_KxN):
  return _sgemm(x_MxK, w_KxN), (x_MxK, w_KxN)


def _matmul_bwd(res, dy_MxN):
  x_MxK, w_KxN = res  # dx = dy w^T, dw = x^T dy: the transposes are the handler's flags
  return _sgemm(dy_MxN, w_KxN, trans_b=True), _sgemm(x_MxK, dy_MxN, trans_a=True)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                **kwargs):
  """lax.dot_general, with `matmul` for what is one [M, K] x [K, N] float32 product of at least
  MIN_ROWS rows: no batch axes, lhs contracting its trailing axes against rhs's leading ones in
  order (nn.Dense, nn.DenseGeneral over the last axes). Anything else: lax.dot_general."""
  (lc, rc), (lb, rb) = dimension_numbers
  nc = len(lc)
  rows = int(np.prod(lhs.shape[:lhs.ndim - nc]))
  two_d = (not lb and not rb and tuple(lc) == tuple(range(lhs.ndim - nc, lhs.ndim))
           and tuple(rc) == tuple(range(nc)) and lhs.dtype == rhs.dtype == jnp.float32
           and preferred_element_type in (None, jnp.float32) and rows >= MIN_ROWS
           and kwargs.get("out_sharding") is None)
  if not two_d:
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type, **kwargs)
  k = int(np.prod(rhs.shape[:nc]))
  y = matmul(lhs.reshape(rows, k), rhs.reshape(k, -1))
  return y.reshape(*lhs.shape[:lhs.ndim - nc], *rhs.shape[nc:])
