"""backends.cpu.runtime.apply_cpu_defaults, each case in a fresh subprocess (XLA_FLAGS and glibc
tunables are read once per process, and this test process's JAX is already running)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from mtp_jax import hostinfo
from mtp_jax.backends.cpu import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YNN = runtime.CPU_XLA_FLAGS[0]

# Prints what the process saw after apply_cpu_defaults(), once per start of the process.
PROBE = """
import json, os, sys
from mtp_jax import hostinfo
from mtp_jax.backends.cpu import runtime
done = runtime.apply_cpu_defaults()
out = {k: os.environ.get(k) for k in ("XLA_FLAGS", "GLIBC_TUNABLES", "MTP_JAX_REEXECED",
                                      "LD_PRELOAD", "MIMALLOC_PURGE_DELAY")}
out["done"] = done
with open("/proc/self/maps") as f:
  out["mimalloc_mapped"] = "libmimalloc" in f.read()
if "--faults" in sys.argv:  # page faults of calls whose 64 MB temporary is freed between them
  import resource, jax, jax.numpy as jnp
  f = jax.jit(lambda x, v: jnp.sin(x) @ v)
  x, v = jnp.ones((2048, 8192)), jnp.ones((8192, 1))
  for _ in range(3):
    f(x, v).block_until_ready()
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(10):
    f(x, v).block_until_ready()
  out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
if "--compile" in sys.argv:
  import jax, jax.numpy as jnp
  q = jnp.ones((2, 4, 8, 8))
  hlo = jax.jit(lambda a, b: jnp.einsum("bhse,bhte->bhst", a, b)).lower(q, q).compile()
  out["ynn_dot"] = "__ynn_fusion" in hlo.as_text()
print(json.dumps(out))
"""


def _run(env_changes, *args):
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "GLIBC_TUNABLES", runtime.OPT_OUT, runtime.REEXEC_MARK,
                      "LD_PRELOAD", runtime.MIMALLOC_OPT_OUT, *runtime.MIMALLOC_ENV)}
  env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, **env_changes})
  env = {k: v for k, v in env.items() if v is not None}
  res = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True,
                       text=True, timeout=120, check=True)
  lines = res.stdout.strip().splitlines()
  assert len(lines) == 1, res.stdout  # a re-exec prints once, from the second start only
  return json.loads(lines[0])


def test_sets_flags_and_reexecs_once_with_huge_pages():
  out = _run({})
  assert out["XLA_FLAGS"] == YNN
  assert out["GLIBC_TUNABLES"] == runtime.HUGETLB
  assert out["MTP_JAX_REEXECED"] == "1"


MIMALLOC_EXPECTED = sys.platform == "linux" and platform.machine() == "x86_64"  # setup.py


@pytest.mark.slow
def test_mimalloc_preloaded_and_a_freed_block_is_not_faulted_in_again():
  """The re-exec preloads mimalloc (a setup.py dependency here): a 64 MB temporary freed
  between calls is reused, where glibc maps it afresh and faults it in at every call."""
  assert (runtime.mimalloc_path() is not None) == MIMALLOC_EXPECTED
  if not MIMALLOC_EXPECTED:
    return
  out = _run({}, "--faults")
  assert out["LD_PRELOAD"] == runtime.mimalloc_path() and out["mimalloc_mapped"]
  assert out["MIMALLOC_PURGE_DELAY"] == runtime.MIMALLOC_ENV["MIMALLOC_PURGE_DELAY"]
  glibc = _run({runtime.MIMALLOC_OPT_OUT: "0"}, "--faults")
  assert glibc["LD_PRELOAD"] is None and not glibc["mimalloc_mapped"]
  assert glibc["GLIBC_TUNABLES"] == runtime.HUGETLB and glibc["MTP_JAX_REEXECED"] == "1"
  # glibc: the block faulted in at every call, 32 huge pages (or 16k small ones); mimalloc: the
  # block kept (0 here when quiet, 35 in 5 calls beside other tests: other small allocations)
  assert glibc["faults"] >= 10 * 32 and out["faults"] < 10 * 16, (glibc["faults"], out["faults"])
  # an allocator the user chose is kept: their LD_PRELOAD, or a glibc.malloc tunable of theirs
  for env in ({"LD_PRELOAD": runtime.mimalloc_path(), runtime.MIMALLOC_OPT_OUT: None},
              {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}):
    mine = _run(env)
    assert mine["MIMALLOC_PURGE_DELAY"] is None, env
    assert mine["LD_PRELOAD"] == env.get("LD_PRELOAD"), env


def test_flag_takes_effect_and_opt_out_keeps_the_library_dots():
  assert _run({runtime.OPT_OUT: "flags"}, "--compile")["ynn_dot"] is False
  off = _run({runtime.OPT_OUT: "0"}, "--compile")
  assert off["ynn_dot"] is True
  assert off["XLA_FLAGS"] is None and off["GLIBC_TUNABLES"] is None
  assert off["MTP_JAX_REEXECED"] is None


def test_leaves_the_users_settings_alone():
  mine = "--xla_cpu_experimental_ynn_fusion_type=individual_dot --xla_cpu_enable_fast_math=false"
  out = _run({"XLA_FLAGS": mine, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
  assert out["XLA_FLAGS"] == mine
  assert out["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
  assert out["MTP_JAX_REEXECED"] is None  # nothing to re-exec for
  other = _run({"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
  assert other["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {YNN}"
  assert other["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{runtime.HUGETLB}"


@pytest.mark.parametrize("env", [{"JAX_PLATFORMS": "tpu"}, {"JAX_PLATFORMS": "cuda,cpu"}])
def test_nothing_on_an_accelerator_backend(env):
  out = _run(env)
  assert out["done"] == {"applied": False, "why": "not a CPU backend"}
  assert out["XLA_FLAGS"] is None and out["GLIBC_TUNABLES"] is None


def test_merged_xla_flags():
  assert runtime.merged_xla_flags("") == YNN
  assert runtime.merged_xla_flags(" --a=1 ") == f"--a=1 {YNN}"
  assert runtime.merged_xla_flags("--xla_cpu_experimental_ynn_fusion_type=") == (
      "--xla_cpu_experimental_ynn_fusion_type=")


def test_decode_compiler_options(monkeypatch):
  """YNNPACK's dots back for decoding programs of 2+ rows, only where the CPU defaults took them
  away (a user's own ynn flag, or none, is left to XLA_FLAGS); the option compiles."""
  monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=1 {YNN}")
  options = runtime.decode_compiler_options(2)
  assert options == {"xla_cpu_experimental_ynn_fusion_type": runtime.DECODE_YNN_FUSIONS}
  # one row: only on the CPUs measured faster with them (AMD family 25, one Intel model)
  for ids, one_row in ((("AuthenticAMD", 25, 1), options), (("AuthenticAMD", 25, 17), options),
                       (("AuthenticAMD", 26, 2), None), (("GenuineIntel", 6, 143), None),
                       (("GenuineIntel", 6, 167), options),
                       ((None, None, None), None)):
    monkeypatch.setattr(runtime, "cpu_ids", lambda ids=ids: ids)
    assert runtime.decode_compiler_options(1) == one_row, ids
    assert runtime.decode_compiler_options(2) == options, ids
  for flags in ("", "--xla_cpu_experimental_ynn_fusion_type=individual_dot"):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert runtime.decode_compiler_options(8) is None
  import jax
  import jax.numpy as jnp
  x = jnp.ones((4, 64))
  compiled = jax.jit(lambda a, b: a @ b).lower(x, x.T).compile(compiler_options=options)
  assert "ynn" in compiled.as_text()


def test_machine_info_and_every_bench_record_names_its_machine():
  from experiments import common
  info = common.machine_info()
  assert info["cpu_count"] == os.cpu_count() and info["accelerator"]["platform"]
  assert set(info["isa"]) == set(hostinfo.ISA_FLAGS)
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      flags = next((l.split(":", 1)[1].split() for l in f if l.startswith("flags")), [])
    assert info["isa"] == {k: k in flags for k in hostinfo.ISA_FLAGS}
    with open("/proc/cpuinfo") as f:
      family = next((l.split(":", 1)[1].strip() for l in f if l.startswith("cpu family")), None)
    assert info.get("cpu_family") == (int(family) if family else None)
    with open("/proc/cpuinfo") as f:
      vendor = next((l.split(":", 1)[1].strip() for l in f if l.startswith("vendor_id")), None)
    assert runtime.cpu_ids()[:2] == (vendor, int(family) if family else None)
  records = common.stamp([{"a": 1}, {"b": 2, "machine": "kept"}])
  assert records[0]["machine"] == info and records[1]["machine"] == "kept"
  # every experiment that writes a results file stamps it (a bench record names its machine)
  folder = os.path.join(ROOT, "experiments")
  for name in sorted(os.listdir(folder)):
    if name.endswith(".py"):
      with open(os.path.join(folder, name)) as f:
        src = f.read()
      if "json.dump(" in src or ".write(text" in src or "common.emit(" in src:
        # experiments/common.py's write_json / emit stamp what they write
        assert ("common.stamp(" in src or "machine_info()" in src
                or "common.emit(" in src or "common.write_json(" in src), name
  with open(os.path.join(folder, "common.py")) as f:
    assert "stamp(record)" in f.read()
