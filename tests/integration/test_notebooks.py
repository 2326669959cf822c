"""The Colab notebooks run top to bottom at their tiny size on the CPU (nbclient, a real kernel),
and open as a Colab user needs them: the title first, REPO_URL documented, one install cell that
picks the jax extra of the runtime, outputs saved from a CPU run.

Each notebook's first code cell holds its parameters; the test rewrites them (SIZE = "tiny", a
workdir under tmp) and leaves every other cell as a user would run it (the outputs it produces
are not saved: the committed ones come from running the notebook in a checkout).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess

import pytest

from conftest import require

nbformat = require("nbformat")
nbclient = require("nbclient")

COLAB = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "colab")


def _execute(name: str, tmp_path, **params) -> nbformat.NotebookNode:
  nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
  first = [c for c in nb.cells if c.cell_type == "code"][0]
  for key, value in params.items():
    first.source, n = re.subn(rf"^{key} = .*$", f"{key} = {value!r}", first.source, flags=re.M)
    assert n == 1, f"{name}: first cell has no parameter {key}"
  # The kernel is a child process: it inherits this environment (the fast-compile XLA flags of
  # conftest.py, a shared compilation cache) and starts in tmp_path.
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  return nb


def _text(nb) -> str:
  out = []
  for cell in nb.cells:
    for o in cell.get("outputs", []):
      data = o.get("data", {})
      out.append(o.get("text", "") or data.get("text/markdown", "") or data.get("text/plain", ""))
  return "\n".join(out)


def _has_png(nb) -> bool:
  return any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


# Heavy tier: a real kernel runs the notebook's train and generate calls (~25 s), which the CLI
# tests check in make test; the notebook's shape checks below stay there.
@pytest.mark.heavy
def test_quickstart_notebook(tmp_path):
  workdir = str(tmp_path / "quickstart")
  nb = _execute("quickstart.ipynb", tmp_path, SIZE="tiny", WORKDIR=workdir)
  text = _text(nb)
  assert "cpu device(s)" in text
  assert re.search(r"a = \d+\.\d\d tokens per forward, S = \d+\.\d\dx", text), text[-2000:]
  assert "identical to greedy: True" in text
  assert _has_png(nb)  # the per-head loss curves
  assert os.path.isfile(os.path.join(workdir, "summary.json"))


# Heavy tier: a real kernel runs a tiny sweep (~30 s), which tests/integration/test_sweep.py checks
# in make test.
@pytest.mark.heavy
def test_scaling_sweep_notebook(tmp_path):
  root = str(tmp_path / "sweep")
  nb = _execute("scaling_sweep.ipynb", tmp_path, SIZE="tiny", ROOT=root)
  text = _text(nb)
  assert "'d32_l3_n1': 'done'" in text and "'d48_l3_n2': 'done'" in text, text[-3000:]
  assert "| n=2 - n=1 |" in text  # the gain table, as markdown
  assert _has_png(nb)  # the fit
  assert os.path.isfile(os.path.join(root, "results.csv"))
  assert os.path.isfile(os.path.join(root, "scaling.png"))


NOTEBOOKS = ("quickstart.ipynb", "scaling_sweep.ipynb")


def _install_cell(nb) -> str:
  cells = [c.source for c in nb.cells if c.cell_type == "code" and "pip" in c.source]
  assert len(cells) == 1, "one install cell"
  return cells[0]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_opens_as_a_colab_user_needs(name):
  nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
  title = nb.cells[0]
  assert title.cell_type == "markdown" and title.source.startswith("# ")
  assert "REPO_URL" in title.source  # documented before the first code cell
  params = [c for c in nb.cells if c.cell_type == "code"][0].source
  assert re.search(r'^REPO_URL = ""', params, re.M) and re.search(r'^SIZE = "tiny"', params, re.M)
  with open(os.path.join(os.path.dirname(COLAB), "setup.py")) as f:
    pin = re.search(r'"jax(>=[^"]*)"', f.read()).group(1)
  assert f'JAX_PIN = "{pin}"' in params, "JAX_PIN must be setup.py's jax requirement"
  # Saved outputs of a run at SIZE = "tiny": every code cell but the parameters and the install
  # ran, in order, and none failed.
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), name
  assert all(o.get("output_type") != "error" for c in code for o in c.get("outputs", []))
  assert all(c.get("outputs") for c in code[2:]), f"{name}: run it and save the outputs"


def _run_install(nb, monkeypatch, repo_url, *, tpu=False, gpu=False, files=()):
  """The install cell as Colab runs it where mtp_jax is not importable: the pip command it
  would run (subprocess.run recorded, accelerator probes faked)."""
  calls = []

  def fake_run(cmd, **kw):
    calls.append(list(cmd))
    return subprocess.CompletedProcess(cmd, 0 if gpu else 1)

  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "mtp_jax" else find_spec(name, *a))
  monkeypatch.setattr(subprocess, "run", fake_run)
  monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi" if gpu else None)
  import glob as glob_lib
  monkeypatch.setattr(glob_lib, "glob", lambda pattern: (
      ["/dev/accel0"] if tpu and pattern.startswith("/dev/accel") else
      [f for f in files if f.endswith(pattern.rsplit("*", 1)[-1])
       and not pattern.startswith("/dev")]))
  for var in ("COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE"):
    monkeypatch.delenv(var, raising=False)
  exec(_install_cell(nb), {"REPO_URL": repo_url, "JAX_PIN": ">=0.10,<0.11"})
  pip = [c for c in calls if "pip" in c]
  return pip[0][pip[0].index("-q") + 1:] if pip else None


find_spec = importlib.util.find_spec


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_install_cell_picks_the_runtime_jax(name, monkeypatch):
  nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
  url = "https://github.com/someone/mtp_jax"
  git = "mtp_jax @ git+https://github.com/someone/mtp_jax"
  assert _run_install(nb, monkeypatch, url, tpu=True) == [git, "jax[tpu]>=0.10,<0.11"]
  assert _run_install(nb, monkeypatch, url, gpu=True) == [git, "jax[cuda12]>=0.10,<0.11"]
  assert _run_install(nb, monkeypatch, url) == [git]
  assert _run_install(nb, monkeypatch, "", files=["/content/mtp_jax-0.1.0-py3-none-any.whl"]
                      ) == ["/content/mtp_jax-0.1.0-py3-none-any.whl"]
  with pytest.raises(ValueError, match="REPO_URL"):
    _run_install(nb, monkeypatch, "")
  monkeypatch.undo()
  calls = []
  monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
  exec(_install_cell(nb), {"REPO_URL": "", "JAX_PIN": ""})
  assert not calls, "mtp_jax is importable here: nothing to install"
