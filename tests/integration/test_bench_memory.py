"""experiments/bench_memory.py runs to its end (it once crashed at its last line, after every
compile, writing nothing): the tiny mode's records, table and PNG."""

from __future__ import annotations

import json

import pytest

from experiments import bench_memory


# Heavy tier: 24 programs compiled for memory_analysis (~15 s); compiled memory flat in n is
# tests/test_loss.py's in make test.
@pytest.mark.heavy
def test_bench_memory_tiny_writes_its_records_and_plot(tmp_path, capsys):
  out, png = tmp_path / "m.json", tmp_path / "m.png"
  bench_memory.main(["--json", str(out), "--png", str(png), "--tiny"])
  records = json.loads(out.read_text())
  assert len(records) == 2 * 2 * len(bench_memory.VARIANTS)  # loss, train_step x n 1, 2
  for r in records:
    assert r["temp_bytes"] > 0 and r["machine"]["cpu_count"] and r["config"]["jax"]
  naive = {r["n_future"]: r["temp_bytes"] for r in records
           if (r["what"], r["impl"]) == ("loss", "naive")}
  assert naive[2] > naive[1]  # the naive loss holds every head's logits
  assert png.stat().st_size > 10_000
  assert "| loss | scan | 1 |" in capsys.readouterr().out
