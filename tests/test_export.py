"""Exports with the heads: `convert to-meta` (parallel heads, Meta's layout) and `convert
to-deepseek` (sequential heads, DeepSeek-V3 MTP layers) round-trip through our own importers
(`convert meta`, `convert deepseek`) with equal logits for every head; another kind or preset is
one error line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import require

torch = require("torch")
require("safetensors")
from mtp_jax import convert, generate  # noqa: E402
from mtp_jax.model import logits  # noqa: E402


def _all_heads(params, model, tokens_BxS):
  h_NxBxSxD, _ = model.apply({"params": params}, tokens_BxS)
  return np.asarray(logits(params, model.args, h_NxBxSxD))


@pytest.mark.parametrize("kind,command,tied,scan", [
    ("parallel", "to-meta", True, False), ("sequential", "to-deepseek", False, True)])
@pytest.mark.slow
def test_export_round_trips_every_head(kind, command, tied, scan, make_config, make_model,
                                       tmp_path):
  c = make_config(kind, 3)
  m = c.model
  m.vocab_size, m.tie_embeddings, m.scan_layers = 259, tied, scan  # the byte tokenizer's ids
  m.d_model, m.n_heads, m.n_kv_heads, m.d_ff = 64, 4, 2, 96  # d_ff not Meta's default: kept
  if kind == "sequential":
    m.heads.seq_preset = "deepseek_v3"
  model, params = make_model(c)
  wd, out, back = str(tmp_path / "wd"), str(tmp_path / "out"), str(tmp_path / "back")
  convert.write_workdir(wd, c, params)
  assert convert.main([command, "--workdir", wd, "--out", out]) == 0
  if command == "to-meta":
    with open(os.path.join(out, "params.json")) as f:
      p = json.load(f)
    assert (p["n_future_tokens"], p["n_layers"], p["vocab_size"]) == (3, m.n_layers, 259)
    sd = torch.load(os.path.join(out, "consolidated.00.pth"), weights_only=True)
    assert sorted(k for k in sd if k.startswith("extra_heads.") and k.endswith("wq.weight")) \
        == ["extra_heads.0.attention.wq.weight", "extra_heads.1.attention.wq.weight"]
    assert sd["tok_embeddings.weight"].shape == (259, 64)  # the real rows, pad rows dropped
  else:
    with open(os.path.join(out, "config.json")) as f:
      assert json.load(f)["num_nextn_predict_layers"] == 2
  assert convert.main([command[3:], "--ckpt", out, "--out", back]) == 0
  loaded = generate.load_workdir(back)
  a = loaded.model.args
  assert (a.head_kind, a.n_future, a.n_trunk, a.d_ff) == (kind, 3, model.args.n_trunk, 96)
  tokens_BxS = np.random.default_rng(0).integers(0, 259, (2, 12)).astype(np.int32)
  ours, theirs = _all_heads(params, model, tokens_BxS), _all_heads(loaded.params, loaded.model,
                                                                   tokens_BxS)
  assert ours.shape == theirs.shape == (3, 2, 12, 259)
  for j in range(3):
    np.testing.assert_allclose(theirs[j], ours[j], atol=1e-5, rtol=1e-5, err_msg=f"head {j + 1}")


def test_export_refuses_the_wrong_kind(make_config, make_model, tmp_path, capsys):
  c = make_config("sequential", 2)
  c.model.vocab_size, c.model.heads.seq_preset = 259, "maxtext"
  wd = str(tmp_path / "wd")
  convert.write_workdir(wd, c, make_model(c)[1])
  for command, match in (("to-meta", "has sequential heads; to-meta writes Meta's layout"),
                         ("to-deepseek", "seq_output_norm 'shared'")):
    assert convert.main([command, "--workdir", wd, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --workdir: ") and match in err[0], err
    assert not os.path.exists(tmp_path / "o")


def test_export_refuses_model_family_features(make_config, make_model, tmp_path, capsys):
  """Meta's and DeepSeek's layouts are a plain Llama: q/k/v biases have nowhere to go."""
  c = make_config("parallel", 2)
  c.model.vocab_size, c.model.qkv_bias = 259, True
  wd = str(tmp_path / "wd")
  convert.write_workdir(wd, c, make_model(c)[1])
  for command in ("to-meta", "to-deepseek"):
    assert convert.main([command, "--workdir", wd, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.qkv_bias = True" in err[0], err
    assert not os.path.exists(tmp_path / "o")
