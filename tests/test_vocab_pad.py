"""Padded vocabulary (model.vocab_multiple): the padded model is the unpadded one with extra
rows that never matter. Same real weights, pad rows random and huge (they would win every
argmax if they leaked): equal loss, metrics and real gradients (zero on the pad rows), equal
logits of the real ids, greedy and speculative decoding emit the same tokens (no pad id).
Workdirs saved before the field existed load unpadded; checkpoint import pads with zeros and
export keeps the real size."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import traverse_util

from mtp_jax import config as config_lib
from mtp_jax.config import validation
from mtp_jax import convert
from mtp_jax.decoding import decode as decode_lib
from mtp_jax import generate
from mtp_jax import loss as loss_lib
from mtp_jax.backends.cpu import ops as cpu_ops
from mtp_jax.model import build_model, init_params, mask_pad_logits, unembedding
from mtp_jax.model import logits as model_logits

V = 61  # tiny_config's vocabulary: padded to 64 here (a multiple of 32), 128 by default
PAD_SCALE = 50.0  # pad rows this many times larger than the real ones: they would win


def _pair(make_config, make_model, kind, n_future=3, tie=True, multiple=32):
  """(padded model, its params, unpadded model, its params): the same real weights; the pad
  rows of the padded embedding (and untied unembedding) random and huge."""
  c1 = make_config(kind, n_future)
  c1.model.vocab_multiple, c1.model.tie_embeddings = 1, tie
  c1.loss.token_chunks = 2
  model1, params1 = make_model(c1)
  cp = c1.copy_and_resolve_references()
  cp.model.vocab_multiple = multiple
  model_p = build_model(cp)
  assert (model1.args.padded_vocab, model_p.args.padded_vocab) == (V, 64)
  rng = np.random.default_rng(7)
  params_p = jax.tree.map(np.asarray, dict(params1))
  emb = np.asarray(params1["embed"]["embedding"])
  pad = PAD_SCALE * rng.standard_normal((64 - V, emb.shape[1])).astype(np.float32)
  params_p["embed"] = {"embedding": np.concatenate([emb, pad])}
  if not tie:
    un = np.asarray(params1["unembed"])
    params_p["unembed"] = np.concatenate([un, PAD_SCALE * rng.standard_normal(
        (un.shape[0], 64 - V)).astype(np.float32)], axis=1)
  shapes = jax.eval_shape(lambda: init_params(model_p, jax.random.PRNGKey(0)))
  assert jax.tree.map(lambda s: s.shape, shapes) == jax.tree.map(np.shape, params_p)
  return cp, model_p, params_p, c1, model1, params1


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (2, 16)).astype(np.int32)
  seg = np.ones((2, 16), np.int32)
  seg[0, 10:] = 2
  return {"tokens": tokens, "segment_ids": seg}


# Heavy tier: parallel heads, tied, cut cross-entropy (~13 s); the cut loss on a padded vocabulary
# stays in make test with sequential untied heads, the tied unembedding with the full loss.
@pytest.mark.parametrize("kind,tie,cut", [
    pytest.param("parallel", True, True, marks=pytest.mark.heavy), ("sequential", False, True),
    ("parallel", True, False)])
@pytest.mark.slow
def test_loss_grads_and_logits_equal_unpadded(make_config, make_model, kind, tie, cut,
                                              monkeypatch):
  """cut: on one CPU device the loss multiplies the real columns only; else (as on a mesh) it
  masks the pad columns' logits."""
  if not cut:
    monkeypatch.setattr(cpu_ops, "real_vocab_only", lambda: False)
  cp, model_p, params_p, c1, model1, params1 = _pair(make_config, make_model, kind, tie=tie)
  batch = _batch()
  hlo = jax.jit(lambda p: loss_lib.model_loss(p, model_p, cp, batch)[0]).lower(
      params_p).as_text()
  # a token tile's logits (2 rows x 8 tokens): [16, 61] when cut, [16, 64] when masked
  assert ("<16x61xf32>" in hlo, "<16x64xf32>" in hlo) == (cut, not cut)

  def value_and_grad(model, config, params, naive):
    fn = lambda p: loss_lib.model_loss(p, model, config, batch, naive=naive)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(params)

  for naive in (False, True):  # the scanned loss (2 token tiles) and the naive reference
    (l1, m1), g1 = value_and_grad(model1, c1, params1, naive)
    (lp, mp), gp = value_and_grad(model_p, cp, params_p, naive)
    np.testing.assert_allclose(lp, l1, rtol=1e-6)
    for k in ("head_loss", "head_acc", "head_agree"):
      np.testing.assert_allclose(mp[k], m1[k], rtol=1e-6, atol=1e-7, err_msg=k)
    flat_p, flat_1 = traverse_util.flatten_dict(gp), traverse_util.flatten_dict(g1)
    for path, g in flat_1.items():
      real = flat_p[path]
      if path == ("embed", "embedding"):
        assert np.all(np.asarray(real[V:]) == 0)  # pad rows: never looked up, masked logits
        real = real[:V]
      elif path == ("unembed",):
        assert np.all(np.asarray(real[:, V:]) == 0)
        real = real[:, :V]
      np.testing.assert_allclose(real, g, rtol=1e-5, atol=1e-6, err_msg=str(path))

  # decoding=True: sequential depth 2 reads depth 1's draft (an argmax over the unembedding).
  for decoding in (False, True):
    h_p, _ = model_p.apply({"params": params_p}, batch["tokens"], decoding=decoding)
    h_1, _ = model1.apply({"params": params1}, batch["tokens"], decoding=decoding)
    lp, l1 = model_logits(params_p, model_p.args, h_p), model_logits(params1, model1.args, h_1)
    assert lp.shape[-1] == V  # the real ids only
    np.testing.assert_allclose(lp, l1, rtol=1e-5, atol=1e-5, err_msg=f"decoding={decoding}")
  # The setup is adversarial: unmasked, the pad columns win most argmaxes.
  raw = np.einsum("nbsd,dv->nbsv", h_p, unembedding(params_p, model_p.args))
  assert np.mean(raw.argmax(-1) >= V) > 0.8
  assert np.all(np.asarray(mask_pad_logits(raw, V)).argmax(-1) < V)


@pytest.mark.slow
# Heavy tier for parallel and projection (~15 s): the pad columns are cut from the one
# unembedding every kind decodes through; sequential, whose depths also draw drafts from it,
# stays in make test.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.heavy) for k in
                                  ("parallel", "projection")] + ["sequential"])
def test_decoding_never_emits_a_pad_id(make_config, make_model, kind):
  """Greedy and speculative decoding of the padded model give the unpadded model's tokens (the
  sequential depths draft through the real columns only)."""
  _, model_p, params_p, _, model1, params1 = _pair(make_config, make_model, kind)
  prompts = [[5, 9, 1], [7], [3, 3, 8, 2, 11]]
  kw = dict(max_new_tokens=12, eos_id=V - 1, pad_id=V - 2)
  for k in (1, 3):
    ref = decode_lib.decode(params1, model1.args, prompts, k=k, **kw)
    got = decode_lib.decode(params_p, model_p.args, prompts, k=k, **kw)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    np.testing.assert_array_equal(got.accepted_hist, ref.accepted_hist)
    assert np.all(got.tokens < V)


def test_padded_vocab_and_validation(make_config):
  c = make_config()
  assert c.model.vocab_multiple == 128 and build_model(c).args.padded_vocab == 128
  c.model.vocab_size = 259  # the byte tokenizer's
  assert build_model(c).args.padded_vocab == 384
  c.model.vocab_multiple = 1
  assert build_model(c).args.padded_vocab == 259
  c.model.vocab_multiple = 0
  with pytest.raises(ValueError, match=r"^config\.model\.vocab_multiple: must be >= 1, got 0$"):
    validation.validate(c)


def test_workdir_saved_before_vocab_multiple_loads_unpadded(make_config, make_model, tmp_path):
  """config.json without model.vocab_multiple (an older run): read as 1, so the saved unpadded
  embedding restores; a config that names it keeps its value."""
  c = make_config("projection", 2)
  c.model.vocab_multiple = 1
  _, params = make_model(c)
  out = str(tmp_path / "old")
  convert.write_workdir(out, c, params)
  path = os.path.join(out, "config.json")
  with open(path) as f:
    saved = json.load(f)
  del saved["model"]["vocab_multiple"]
  with open(path, "w") as f:
    json.dump(saved, f)
  assert config_lib.load_json(path).model.vocab_multiple == 1
  loaded = generate.load_workdir(out)
  assert loaded.params["embed"]["embedding"].shape == (V, 32)
  np.testing.assert_array_equal(loaded.params["embed"]["embedding"],
                                params["embed"]["embedding"])
  saved["model"]["vocab_multiple"] = 32
  with open(path, "w") as f:
    json.dump(saved, f)
  assert config_lib.load_json(path).model.vocab_multiple == 32


class _Source:
  """A checkpoint reader (keys, shape, get) over a dict of numpy arrays."""

  def __init__(self, tensors):
    self.tensors = tensors

  def keys(self):
    return self.tensors.keys()

  def shape(self, key):
    return tuple(self.tensors[key].shape)

  def get(self, key):
    return self.tensors[key]


def test_import_pads_with_zeros_and_export_keeps_the_real_size(make_config):
  """A Llama layout of the real vocabulary (61 rows) fills the first rows of our padded (128)
  embedding and untied unembedding, pad rows zero; the export tensors are the originals."""
  c = make_config("projection", 2)
  c.model.tie_embeddings = False
  args, shapes = convert.param_shapes(c)
  assert args.padded_vocab == 128
  entries = convert.llama_entries(args)
  rng = np.random.default_rng(0)
  tensors = {e.src: rng.standard_normal(convert.torch_shape(e, convert.real_shape(
      e, shapes[e.dst].shape[0 if e.index is None else 1:]))).astype(np.float32)
      for e in entries}
  assert tensors["model.embed_tokens.weight"].shape == tensors["lm_head.weight"].shape == (V, 32)
  source = _Source(tensors)
  convert.check_tensors(source, entries, shapes, "ckpt", "Llama")
  wanted = {p: s for p, s in shapes.items() if p[0] != "heads"}
  params = traverse_util.flatten_dict(convert.read_params(source, entries, wanted, np.float32))
  emb, un = params[("embed", "embedding")], params[("unembed",)]
  assert emb.shape == (128, 32) and un.shape == (32, 128)
  np.testing.assert_array_equal(emb[:V], tensors["model.embed_tokens.weight"])
  np.testing.assert_array_equal(un[:, :V], tensors["lm_head.weight"].T)
  assert not emb[V:].any() and not un[:, V:].any()
  for e in entries:  # what export_hf writes
    x = params[e.dst] if e.index is None else params[e.dst][e.index]
    np.testing.assert_array_equal(convert.to_torch(convert.unpad(x, e), e), tensors[e.src])
  # A checkpoint of the padded size is refused by name (the foreign tensor is the real size).
  tensors["model.embed_tokens.weight"] = np.zeros((128, 32), np.float32)
  with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight' has shape \(128, 32\), "
                     r"expected \(61, 32\)"):
    convert.check_tensors(source, entries, shapes, "ckpt", "Llama")
