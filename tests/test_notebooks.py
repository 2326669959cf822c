"""The Colab notebooks run top to bottom at their tiny size on the CPU (nbclient, a real kernel).

Each notebook's first cell holds its parameters; the test rewrites them (SIZE = "tiny", a
workdir under tmp) and leaves every other cell as a user would run it.
"""

from __future__ import annotations

import os
import re

from conftest import require

nbformat = require("nbformat")
nbclient = require("nbclient")

COLAB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "colab")


def _execute(name: str, tmp_path, **params) -> nbformat.NotebookNode:
  nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
  first = nb.cells[0]
  assert first.cell_type == "code"
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


def test_quickstart_notebook(tmp_path):
  workdir = str(tmp_path / "quickstart")
  nb = _execute("quickstart.ipynb", tmp_path, SIZE="tiny", WORKDIR=workdir)
  text = _text(nb)
  assert "cpu device(s)" in text
  assert re.search(r"a = \d+\.\d\d tokens per forward, S = \d+\.\d\dx", text), text[-2000:]
  assert "identical to greedy: True" in text
  assert _has_png(nb)  # the per-head loss curves
  assert os.path.isfile(os.path.join(workdir, "summary.json"))


def test_scaling_sweep_notebook(tmp_path):
  root = str(tmp_path / "sweep")
  nb = _execute("scaling_sweep.ipynb", tmp_path, SIZE="tiny", ROOT=root)
  text = _text(nb)
  assert "'d32_l3_n1': 'done'" in text and "'d48_l3_n2': 'done'" in text, text[-3000:]
  assert "| n=2 - n=1 |" in text  # the gain table, as markdown
  assert _has_png(nb)  # the fit
  assert os.path.isfile(os.path.join(root, "results.csv"))
  assert os.path.isfile(os.path.join(root, "scaling.png"))
