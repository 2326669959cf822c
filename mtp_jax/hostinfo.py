"""The host: the first CPU of /proc/cpuinfo (what the CPU backend's defaults rules and a run's
summary name) and the cores this process may use. JAX-free; beneath the backends, so a run's
host description does not go through the CPU backend (`backends.cpu.cpuinfo` re-exports it)."""

from __future__ import annotations

import functools
import os
import platform


@functools.cache
def cpuinfo() -> dict:
  """The first CPU's fields of /proc/cpuinfo (key -> text: "vendor_id", "cpu family", "model",
  "model name", "flags" or "Features", ...), read once; {} where there is none."""
  fields = {}
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, sep, value = line.partition(":")
        if not sep:
          if fields:  # the blank line after the first CPU
            break
          continue
        fields.setdefault(key.strip(), value.strip())
  except OSError:
    pass
  return fields


def cpu_ids() -> tuple:
  """(vendor_id, cpu family, model) of the first CPU in /proc/cpuinfo, None where absent: a VM's
  model name may name no generation, these do."""
  info = cpuinfo()
  def number(key):
    value = info.get(key, "")
    return int(value) if value.isdigit() else None
  return info.get("vendor_id") or None, number("cpu family"), number("model")


# The ISA flags that change XLA:CPU's kernels, named in every timing record.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def isa() -> dict:
  """{flag: present} for ISA_FLAGS, from the first CPU's flags (x86) or Features (Arm)."""
  fields = cpuinfo()
  present = set((fields.get("flags") or fields.get("Features") or "").split())
  return {f: f in present for f in ISA_FLAGS}


def cpu_model_name() -> str:
  """The first CPU's "model name" in /proc/cpuinfo, else what `platform` says."""
  return cpuinfo().get("model name") or platform.processor() or platform.machine()


def machine() -> dict:
  """The host a run's timings come from: CPU model name and the cores this process may use."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return {"cpu": cpu_model_name(), "cpu_cores": cores}
