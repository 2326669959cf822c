"""CPU defaults that an entry point applies before JAX starts its backend.

    if __name__ == "__main__":  # top of an entry-point module, before `import jax`
      from mtp_jax.backends.cpu import runtime
      runtime.apply_cpu_defaults()

On a CPU backend (JAX_PLATFORMS=cpu, or no GPU/TPU plugin installed) it does two things, each
only where the user has not already decided:
- XLA_FLAGS += CPU_XLA_FLAGS. jaxlib 0.10's XLA:CPU hands every dot to the YNNPACK library
  (`--xla_cpu_experimental_ynn_fusion_type`, default "individual_dot"); for the batched
  attention matmuls of a small transformer its kernels are slower than XLA's own
  (docs/cpu_speed.md). A flag already in XLA_FLAGS is never overridden.
- GLIBC_TUNABLES += glibc.malloc.hugetlb=1: malloc asks for transparent huge pages, so the
  ~1 GB of temporaries a train step allocates fault in 2 MB at a time, not 4 kB. glibc reads
  tunables once, at process start, so the process re-executes itself once with it set (same
  interpreter, same `sys.orig_argv`; MTP_JAX_REEXECED marks the second start). Skipped when
  GLIBC_TUNABLES already names the tunable, inside a notebook kernel or pytest, and when JAX
  is already imported (the re-exec would repeat that import's seconds; set it in the launcher).
- LD_PRELOAD = mimalloc (the cmeel-mimalloc wheel, a Linux x86_64 dependency), in the same
  re-exec, with MIMALLOC_PURGE_DELAY=-1: XLA:CPU takes a train step's temporaries as ONE
  block (~1 GB for the default model), which glibc maps afresh and unmaps at every step (a
  block over its 64 MB arena heaps always is, from a non-main thread, whatever the tunables),
  so every step faulted its pages in and zeroed them again (on a KVM guest whose freed pages go
  back to the host, up to seconds of kernel time in some steps). mimalloc keeps
  freed memory in the process (never purged) and hands the block to the next step. Skipped
  where LD_PRELOAD is set or GLIBC_TUNABLES already names a glibc.malloc tunable (the user
  chose an allocator), and with MTP_JAX_MIMALLOC=0. Child processes inherit both, as they do
  GLIBC_TUNABLES.

Decoding programs of 2+ rows (of 1 row too on the CPUs of YNN_ONE_ROW_CPUS) then get
YNNPACK's dots back per program (`decode_compiler_options`, where that flag is in XLA_FLAGS).

MTP_JAX_CPU_DEFAULTS=0 turns all of this off; MTP_JAX_CPU_DEFAULTS=flags keeps the XLA flags
and skips the re-exec; MTP_JAX_MIMALLOC=0 keeps glibc's malloc.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys

from mtp_jax.backends.cpu.cpuinfo import cpu_ids

OPT_OUT = "MTP_JAX_CPU_DEFAULTS"
REEXEC_MARK = "MTP_JAX_REEXECED"
# XLA:CPU's option naming what YNNPACK runs (a flag, and a per-program compile option).
YNN_FUSION_OPTION = "xla_cpu_experimental_ynn_fusion_type"
CPU_XLA_FLAGS = (f"--{YNN_FUSION_OPTION}=-individual_dot",)
HUGETLB = "glibc.malloc.hugetlb=1"
MIMALLOC_OPT_OUT = "MTP_JAX_MIMALLOC"
# Freed memory is never given back to the OS (mimalloc's default purges it after 10 ms): the
# next train step reuses the last one's temporaries, and the process holds its peak, as glibc's
# heap does (a purge delay of seconds still gave the step's block back now and then).
MIMALLOC_ENV = {"MIMALLOC_PURGE_DELAY": "-1"}
_ACCELERATOR_MODULES = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                        "jax_rocm7_plugin", "libtpu")


def cpu_backend_expected(environ=None) -> bool:
  """True when JAX will start on the CPU: JAX_PLATFORMS names cpu first, or it is unset and no
  accelerator plugin is installed. Decided without starting (or importing) JAX."""
  environ = os.environ if environ is None else environ
  platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
  if platforms:
    return platforms.split(",")[0] == "cpu"
  return not any(importlib.util.find_spec(m) is not None for m in _ACCELERATOR_MODULES)


def _backend_started() -> bool:
  jax_mod = sys.modules.get("jax")
  if jax_mod is None:
    return False
  bridge = sys.modules.get("jax._src.xla_bridge")
  return bool(getattr(bridge, "_backends", None))


def merged_xla_flags(current: str, defaults=CPU_XLA_FLAGS) -> str:
  """`current` plus each default whose flag name it does not already set."""
  names = {f.split("=", 1)[0] for f in current.split()}
  extra = [f for f in defaults if f.split("=", 1)[0] not in names]
  return " ".join([current.strip(), *extra]).strip()


@functools.cache
def mimalloc_path() -> str | None:
  """The libmimalloc.so of the installed cmeel-mimalloc wheel, or None."""
  try:
    files = importlib.metadata.files("cmeel-mimalloc") or ()
  except importlib.metadata.PackageNotFoundError:
    return None
  for f in files:
    if str(f).endswith("lib/libmimalloc.so") and os.path.isfile(f.locate()):
      return str(f.locate())
  return None


def _switched_off(value: str) -> bool:
  """Whether an opt-out variable's value says off (0, false, off, no; any case)."""
  return value.strip().lower() in ("0", "false", "off", "no")


def _mimalloc_preload(environ) -> str | None:
  """mimalloc's path where the re-exec should preload it: found, not opted out of, and the user
  has chosen no allocator (no LD_PRELOAD, no glibc.malloc tunable of their own)."""
  if _switched_off(environ.get(MIMALLOC_OPT_OUT, "1")):
    return None
  if environ.get("LD_PRELOAD") or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
    return None
  return mimalloc_path()


def _in_notebook_or_tests() -> bool:
  return "ipykernel" in sys.modules or "pytest" in sys.modules


def apply_cpu_defaults(reexec: bool = True) -> dict:
  """Applies the CPU defaults (see the module docstring); returns what it did, for logging.
  Call it before JAX starts its backend: afterwards XLA_FLAGS is no longer read."""
  mode = os.environ.get(OPT_OUT, "1").strip().lower()
  if _switched_off(mode):
    return {"applied": False, "why": f"{OPT_OUT}={mode}"}
  if not cpu_backend_expected():
    return {"applied": False, "why": "not a CPU backend"}
  if _backend_started():
    return {"applied": False, "why": "the JAX backend is already running"}
  os.environ["XLA_FLAGS"] = merged_xla_flags(os.environ.get("XLA_FLAGS", ""))
  done = {"applied": True, "xla_flags": os.environ["XLA_FLAGS"], "reexec": False}
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  preload = _mimalloc_preload(os.environ)
  want_reexec = (reexec and mode != "flags"
                 and ("glibc.malloc.hugetlb" not in tunables or preload)
                 and not os.environ.get(REEXEC_MARK) and not _in_notebook_or_tests()
                 and "jax" not in sys.modules and sys.platform.startswith("linux")
                 and getattr(sys, "orig_argv", None))
  if want_reexec:
    if "glibc.malloc.hugetlb" not in tunables:
      os.environ["GLIBC_TUNABLES"] = f"{tunables}:{HUGETLB}" if tunables else HUGETLB
    if preload:
      os.environ["LD_PRELOAD"] = preload
      for k, v in MIMALLOC_ENV.items():
        os.environ.setdefault(k, v)
    os.environ[REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
  return done


# jaxlib 0.10's own YNNPACK list (what XLA_FLAGS without CPU_XLA_FLAGS gives): the dots too.
DECODE_YNN_FUSIONS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"


# CPUs where YNNPACK's dots also win at one row, as prefixes of `cpu_ids()` (vendor_id, cpu
# family[, model]) of /proc/cpuinfo; every other CPU keeps XLA's own matrix-vector loop at one
# row until measured (the measurements per CPU: docs/cpu_speed.md).
YNN_ONE_ROW_CPUS = (("AuthenticAMD", 25), ("GenuineIntel", 6, 167))


def ynn_one_row() -> bool:
  """Whether this CPU is one of YNN_ONE_ROW_CPUS."""
  ids = cpu_ids()
  return any(ids[:len(entry)] == entry for entry in YNN_ONE_ROW_CPUS)


def decode_compiler_options(batch: int) -> dict | None:
  """`compile()` options of a decoding program of `batch` rows (`decoding.decode.Decoder`):
  where the CPU defaults took YNNPACK's dots away (CPU_XLA_FLAGS in XLA_FLAGS, a CPU backend),
  a program of 2 or more rows gets them back: its matmuls have 2 to 16 * k rows, where Eigen's
  GEMM was the slower (docs/cpu_speed.md). One row (a matrix-vector product) gets them on the
  CPUs of YNN_ONE_ROW_CPUS only. Every program of a batch (plain, chain and tree, the cost model's
  probes) compiles alike: speculative decoding is exact because a window's rows and a one-token
  step's are summed by the same kernels."""
  if batch < (1 if ynn_one_row() else 2):
    return None
  if CPU_XLA_FLAGS[0] not in os.environ.get("XLA_FLAGS", "").split():
    return None
  import jax
  if jax.default_backend() != "cpu":
    return None
  return {YNN_FUSION_OPTION: DECODE_YNN_FUSIONS}
