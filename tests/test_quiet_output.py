"""What a user reads besides the results: a local tfds build prints one line of its own (no tfds
"Downloading and preparing dataset Unknown size" for a folder), and a power-law fit of too few
points says so instead of an r² of 1."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import copy_code_corpus

from mtp_jax import config as config_lib
from mtp_jax.sweeps import scaling
from mtp_jax.data import corpus as corpus_lib


def test_local_build_prints_no_download_lines(tmp_path, capfd):
  corpus = copy_code_corpus(tmp_path)
  c = config_lib.base_config()
  c.data.corpus, c.data.folder, c.data.dir = "text_folder", corpus["folder"], corpus["data_dir"]
  builder = corpus_lib.get(c.data).prepare(c.data)
  assert builder.data_path.exists()
  out, err = capfd.readouterr()
  assert "building the text_folder dataset" in out, out
  for text in ("Downloading", "Unknown size", "downloaded and prepared"):
    assert text not in out + err, out + err


def test_fit_quality_needs_three_points():
  two = scaling.fit_power_law([1e3, 1e4], [3.0, 2.5])
  assert two["r2"] is None and two["points"] == 2 and two["b"] < 0
  assert scaling.fit_quality(two).startswith("2 sizes: too few points for a fit quality")
  x = np.array([1e3, 1e4, 1e5])
  three = scaling.fit_power_law(x, 5.0 * x ** -0.1 * np.array([1.0, 1.02, 0.99]))
  assert 0.9 < three["r2"] < 1.0
  assert scaling.fit_quality(three) == f"r² {three['r2']:.3f}, 3 sizes"
  exact = scaling.fit_power_law(x, 5.0 * x ** -0.1)
  assert exact["r2"] == pytest.approx(1.0) and exact["b"] == pytest.approx(-0.1)
