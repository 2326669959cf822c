"""The CPU backend stays behind its seam (mtp_jax.backends): importing the core loads neither the
MKL handler (backends.cpu.gemm) nor the process defaults and their re-exec
(backends.cpu.runtime), and the core modules reach backends/cpu/ only through the seam."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN = ("mtp_jax.backends.cpu.gemm", "mtp_jax.backends.cpu.runtime")


def _loaded_after(code: str, env_changes: dict | None = None) -> list[str]:
  probe = (f"{code}\nimport json, sys\n"
           f"print(json.dumps([m for m in {HIDDEN!r} if m in sys.modules]))")
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **(env_changes or {})}
  res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                       timeout=120, check=True, cwd=ROOT)
  return json.loads(res.stdout.strip().splitlines()[-1])


def test_core_import_loads_no_mkl_handler_or_reexec():
  assert _loaded_after("import mtp_jax.model, mtp_jax.loss, mtp_jax.steps") == []


def test_cpu_runtime_imports_no_jax():
  """The entry points import backends.cpu.runtime before JAX: its re-exec is skipped once jax is
  imported, so neither it nor the packages above it may import jax."""
  code = "import mtp_jax.backends.cpu.runtime, sys\nassert 'jax' not in sys.modules, 'jax'"
  assert _loaded_after(code) == ["mtp_jax.backends.cpu.runtime"]


def test_mkl_handler_loaded_when_the_option_asks():
  """A config asking for model.cpu_matmul = mkl on a CPU loads the handler (validation asks it
  whether it is available); the default config does not."""
  code = ("from mtp_jax.config import validation\nfrom configs import tiny\nc = tiny.get_config()\n"
          "c.model.cpu_matmul = {!r}\n"
          "try:\n  validation.validate(c)\nexcept ValueError:\n  pass\n")
  assert _loaded_after(code.format("xla")) == []
  assert _loaded_after(code.format("mkl")) == ["mtp_jax.backends.cpu.gemm"]


def test_core_reaches_the_cpu_backend_through_the_seam_only():
  """layers, model, loss, steps and decoding import `mtp_jax.backends` (the seam), never a
  module of backends/cpu/ (attention's `cpu` kernel is chosen by attention.resolve, and
  validation asks the MKL handler only for cpu_matmul = mkl)."""
  allowed = {"attention.py": {"mtp_jax.backends.cpu.attention"},
             os.path.join("config", "validation.py"): {"mtp_jax.backends.cpu"}}
  for name in ("layers.py", "model.py", "loss.py", "steps.py", "attention.py",
               os.path.join("config", "validation.py"),
               os.path.join("decoding", "decode.py")):
    with open(os.path.join(ROOT, "mtp_jax", name), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             if n.module and n.module.startswith("mtp_jax.backends.cpu")}
    assert found <= allowed.get(name, set()), (name, found)
