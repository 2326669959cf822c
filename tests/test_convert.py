"""mtp_jax.convert: Meta and DeepSeek imports against torch reference forwards written here from
each layout (Meta's interleaved complex RoPE, HF's rotate-half), the HF export against
transformers' LlamaForCausalLM, and the one-line errors."""

from __future__ import annotations

import io
import json
import math
import os

import numpy as np
import pytest
from conftest import require

torch = require("torch")
require("safetensors")
import sentencepiece as spm  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from mtp_jax import convert, generate  # noqa: E402
from mtp_jax.model import logits  # noqa: E402

D, H, K, V, S, EPS, THETA = 64, 4, 2, 100, 12, 1e-5, 500000.0  # Llama 3's theta
E = D // H
META_LAYERS, META_FUTURE = 5, 3  # layers.0-2 (trunk 0-1 + head 1), extra_heads.0-1
DS_LAYERS, DS_DEPTHS, DS_FF = 2, 2, 96
TEXT = ["the cat sat on the mat and the dog sat on the log", "a big red fox ran to the den",
        "we see the sun and the moon over the sea"] * 20


# Torch reference forwards.


def _rms(x, w):
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope_meta(x_BxSxHxE):
  """Meta's llama: interleaved pairs as complex numbers times freqs_cis."""
  freqs = 1.0 / (THETA ** (torch.arange(0, E, 2)[:E // 2].float() / E))
  freqs_cis = torch.polar(torch.ones(x_BxSxHxE.shape[1], E // 2),
                          torch.outer(torch.arange(x_BxSxHxE.shape[1]).float(), freqs))
  xc = torch.view_as_complex(x_BxSxHxE.float().reshape(*x_BxSxHxE.shape[:-1], -1, 2))
  return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)


def _rope_hf(x_BxSxHxE):
  """HF Llama: rotate_half with cos/sin of cat(freqs, freqs)."""
  inv = 1.0 / (THETA ** (torch.arange(0, E, 2).float() / E))
  ang = torch.outer(torch.arange(x_BxSxHxE.shape[1]).float(), inv)
  emb = torch.cat([ang, ang], -1)
  cos, sin = emb.cos()[None, :, None], emb.sin()[None, :, None]
  x1, x2 = x_BxSxHxE[..., :E // 2], x_BxSxHxE[..., E // 2:]
  return x_BxSxHxE * cos + torch.cat([-x2, x1], -1) * sin


def _block(w, x_BxSxD, rope):
  B, S_ = x_BxSxD.shape[:2]
  h = _rms(x_BxSxD, w["attn_norm"])
  q = rope((h @ w["q"].T).view(B, S_, H, E))
  k = rope((h @ w["k"].T).view(B, S_, K, E)).repeat_interleave(H // K, dim=2)
  v = (h @ w["v"].T).view(B, S_, K, E).repeat_interleave(H // K, dim=2)
  att = torch.einsum("bshe,bthe->bhst", q, k) / math.sqrt(E)
  att = att.masked_fill(~torch.ones(S_, S_, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
  x_BxSxD = x_BxSxD + torch.einsum("bhst,bthe->bshe", att, v).reshape(B, S_, D) @ w["o"].T
  h = _rms(x_BxSxD, w["ffn_norm"])
  return x_BxSxD + (torch.nn.functional.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T


_ROLES = ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "ffn_norm")


def _weights(sd, prefix, meta):
  return {role: sd[f"{prefix}{row[1] if meta else row[2]}.weight"]
          for role, row in zip(_ROLES, convert.BLOCK)}


def meta_reference(sd, tokens_BxS):
  """Meta's Transformer.forward(return_all_heads=True): [n_future, B, S, V]."""
  n_trunk = META_LAYERS - META_FUTURE
  x = sd["tok_embeddings.weight"][tokens_BxS]
  for i in range(n_trunk):
    x = _block(_weights(sd, f"layers.{i}.", True), x, _rope_meta)
  heads = [f"layers.{n_trunk}."] + [f"extra_heads.{j}." for j in range(META_FUTURE - 1)]
  return torch.stack([_rms(_block(_weights(sd, p, True), x, _rope_meta), sd["norm.weight"])
                      @ sd["output.weight"].T for p in heads])


def deepseek_reference(sd, tokens_BxS):
  """Main model, then MTP module k (DeepSeek-V3 weights / vLLM deepseek_mtp):
  h_k = block(eh_proj([enorm(emb(x_{t+k})); hnorm(h_{k-1})])), h_0 the final-normed state,
  logits_k = shared_head.head(shared_head.norm(h_k)). Head k has S - k positions."""
  emb = sd["model.embed_tokens.weight"]
  x = emb[tokens_BxS]
  for i in range(DS_LAYERS):
    x = _block(_weights(sd, f"model.layers.{i}.", False), x, _rope_hf)
  h = _rms(x, sd["model.norm.weight"])
  out = [h @ sd["lm_head.weight"].T]
  for k in range(1, DS_DEPTHS + 1):
    p = f"model.layers.{DS_LAYERS + k - 1}."
    e = _rms(emb[tokens_BxS[:, k:]], sd[p + "enorm.weight"])
    hk = _rms(h[:, :S - k], sd[p + "hnorm.weight"])
    h = _block(_weights(sd, p, False), torch.cat([e, hk], -1) @ sd[p + "eh_proj.weight"].T,
               _rope_hf)
    out.append(_rms(h, sd[p + "shared_head.norm.weight"]) @ sd[p + "shared_head.head.weight"].T)
  return out


# Random checkpoints in each layout.


def _block_tensors(gen, prefix, names, d_ff):
  shapes = {"q": (H * E, D), "k": (K * E, D), "v": (K * E, D), "o": (D, H * E),
            "gate": (d_ff, D), "up": (d_ff, D), "down": (D, d_ff)}
  out = {}
  for role, row in zip(_ROLES, convert.BLOCK):
    name = f"{prefix}{row[names]}.weight"
    if role in shapes:
      out[name] = torch.randn(shapes[role], generator=gen) / math.sqrt(shapes[role][1])
    else:
      out[name] = 1 + 0.2 * torch.randn(D, generator=gen)
  return out


def _meta_state(seed=0):
  gen = torch.Generator().manual_seed(seed)
  d_ff = 224  # 32 * ceil(int(1.3 * int(8 * 64 / 3)) / 32)
  sd = {"tok_embeddings.weight": torch.randn(V, D, generator=gen),
        "norm.weight": 1 + 0.2 * torch.randn(D, generator=gen),
        "output.weight": torch.randn(V, D, generator=gen) / math.sqrt(D)}
  for i in range(META_LAYERS - META_FUTURE + 1):
    sd.update(_block_tensors(gen, f"layers.{i}.", 1, d_ff))
  for j in range(META_FUTURE - 1):
    sd.update(_block_tensors(gen, f"extra_heads.{j}.", 1, d_ff))
  return sd


META_PARAMS = {"dim": D, "n_layers": META_LAYERS, "n_heads": H, "n_kv_heads": K,
               "multiple_of": 32, "ffn_dim_multiplier": 1.3, "norm_eps": EPS,
               "rope_theta": THETA, "n_future_tokens": META_FUTURE, "vocab_size": -1}


def _save_meta(folder, sd, shards=1, params=None):
  """params.json and consolidated.NN.pth, split across model-parallel shards as Meta does."""
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "params.json"), "w") as f:
    json.dump(params or META_PARAMS, f)
  for r in range(shards):
    part = {}
    for key, t in sd.items():
      dim = convert.META_SPLIT.get(key.rsplit(".", 2)[-2])
      part[key] = t if dim is None or shards == 1 else t.chunk(shards, dim)[r].clone()
    torch.save(part, os.path.join(folder, f"consolidated.{r:02d}.pth"))
  return str(folder)


def _deepseek_state(seed=1):
  gen = torch.Generator().manual_seed(seed)
  emb, head = torch.randn(V, D, generator=gen), torch.randn(V, D, generator=gen) / math.sqrt(D)
  sd = {"model.embed_tokens.weight": emb, "lm_head.weight": head,
        "model.norm.weight": 1 + 0.2 * torch.randn(D, generator=gen)}
  for i in range(DS_LAYERS + DS_DEPTHS):
    sd.update(_block_tensors(gen, f"model.layers.{i}.", 2, DS_FF))
  for k in range(DS_DEPTHS):
    p = f"model.layers.{DS_LAYERS + k}."
    sd.update({p + "enorm.weight": 1 + 0.2 * torch.randn(D, generator=gen),
               p + "hnorm.weight": 1 + 0.2 * torch.randn(D, generator=gen),
               p + "shared_head.norm.weight": 1 + 0.2 * torch.randn(D, generator=gen),
               p + "eh_proj.weight": torch.randn(D, 2 * D, generator=gen) / math.sqrt(2 * D),
               p + "embed_tokens.weight": emb.clone(), p + "shared_head.head.weight": head.clone()})
  return sd


DS_CONFIG = {"hidden_size": D, "num_hidden_layers": DS_LAYERS, "num_attention_heads": H,
             "num_key_value_heads": K, "intermediate_size": DS_FF, "rms_norm_eps": EPS,
             "rope_theta": THETA, "vocab_size": V, "tie_word_embeddings": False,
             "num_nextn_predict_layers": DS_DEPTHS, "max_position_embeddings": 64,
             "hidden_act": "silu"}


def _save_deepseek(folder, sd, config=None):
  """Two safetensors files with an index, as HF shards them."""
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config or DS_CONFIG, f)
  keys = sorted(sd)
  files = {"model-00001-of-00002.safetensors": keys[::2],
           "model-00002-of-00002.safetensors": keys[1::2]}
  for name, ks in files.items():
    save_file({k: sd[k].contiguous() for k in ks}, os.path.join(folder, name))
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": {k: n for n, ks in files.items() for k in ks}}, f)
  return str(folder)


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory):
  """A tiny SentencePiece model with Llama's ids: unk 0, bos 1, eos 2, no pad piece."""
  prefix = str(tmp_path_factory.mktemp("spm") / "llama_like")
  spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_prefix=prefix,
                                 vocab_size=60, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                 hard_vocab_limit=False, minloglevel=2, num_threads=1)
  return prefix + ".model"


@pytest.fixture(scope="module")
def tokens_BxS():
  return np.random.default_rng(0).integers(0, V, (2, S)).astype(np.int32)


@pytest.fixture(scope="module")
def meta(tmp_path_factory, spm_path):
  """A 2-shard Meta checkpoint converted through the CLI entry point."""
  root = tmp_path_factory.mktemp("meta")
  sd = _meta_state()
  ckpt = _save_meta(root / "ckpt", sd, shards=2)
  out = str(root / "workdir")
  assert convert.main(["meta", "--ckpt", ckpt, "--out", out, "--tokenizer", spm_path,
                       "--max_len", "64"]) == 0
  return {"sd": sd, "ckpt": ckpt, "workdir": out, "loaded": generate.load_workdir(out)}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, spm_path):
  root = tmp_path_factory.mktemp("deepseek")
  sd = _deepseek_state()
  config = {k: v for k, v in DS_CONFIG.items() if k != "rope_theta"}  # as transformers 5 saves
  ckpt = _save_deepseek(root / "ckpt", sd, dict(config, rope_parameters={
      "rope_type": "default", "rope_theta": THETA}))
  out = str(root / "workdir")
  convert.import_deepseek(ckpt, out, tokenizer=spm_path)
  return {"sd": sd, "ckpt": ckpt, "workdir": out, "loaded": generate.load_workdir(out)}


def _our_logits(loaded, tokens_BxS):
  h_NxBxSxD, _ = loaded.model.apply({"params": loaded.params}, tokens_BxS)
  return np.asarray(logits(loaded.params, loaded.model.args, h_NxBxSxD))


@pytest.mark.slow
def test_meta_logits_match_reference(meta, tokens_BxS):
  args = meta["loaded"].model.args
  assert (args.head_kind, args.n_trunk, args.n_future, args.d_ff) == ("parallel", 2, 3, 224)
  assert not args.tie_embeddings and meta["loaded"].step == 0
  ours_NxBxSxV = _our_logits(meta["loaded"], tokens_BxS)
  ref = meta_reference(meta["sd"], torch.from_numpy(tokens_BxS).long()).numpy()
  assert ours_NxBxSxV.shape == ref.shape == (META_FUTURE, 2, S, V)
  np.testing.assert_allclose(ours_NxBxSxV, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_meta_workdir_generates_speculative_equal_to_greedy(meta):
  buf = io.StringIO()
  report = generate.run(meta["workdir"], ["the cat sat", "a big red fox"], max_new_tokens=8,
                        mode="both", heads=None, out=buf)
  assert report["identical"] and report["heads"] == META_FUTURE, buf.getvalue()
  assert meta["loaded"].tokenizer.pad_id == 0  # Llama's tokenizer has no pad: unk pads


@pytest.mark.slow
def test_deepseek_logits_match_reference(deepseek, tokens_BxS):
  args = deepseek["loaded"].model.args
  assert (args.head_kind, args.n_trunk, args.n_future) == ("sequential", DS_LAYERS, 3)
  assert (args.seq_concat, args.seq_trunk_state, args.seq_output_norm) == (
      "emb_first", "post_norm", "per_module")
  ours_NxBxSxV = _our_logits(deepseek["loaded"], tokens_BxS)
  ref = deepseek_reference(deepseek["sd"], torch.from_numpy(tokens_BxS).long())
  for k, ref_BxSkxV in enumerate(ref):  # head k + 1 has a target for the first S - k positions
    np.testing.assert_allclose(ours_NxBxSxV[k, :, :S - k], ref_BxSkxV.numpy(), atol=1e-4,
                               rtol=1e-4, err_msg=f"head {k + 1}")


def _hf_logits(folder, tokens_BxS):
  transformers = require("transformers")
  model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
  model.eval()
  with torch.no_grad():
    return model(torch.from_numpy(tokens_BxS).long()).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["meta", "deepseek"])
def test_to_hf_matches_transformers(which, meta, deepseek, tokens_BxS, tmp_path):
  fx = {"meta": meta, "deepseek": deepseek}[which]
  out = str(tmp_path / "hf")
  assert convert.main(["to-hf", "--workdir", fx["workdir"], "--out", out]) == 0
  with open(os.path.join(out, "config.json")) as f:
    hf = json.load(f)
  tok = fx["loaded"].tokenizer
  assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (
      tok.bos_id, tok.eos_id, tok.pad_id)
  assert hf["num_hidden_layers"] == (META_LAYERS - META_FUTURE + 1 if which == "meta"
                                     else DS_LAYERS)
  assert os.path.isfile(os.path.join(out, "tokenizer.model"))
  ref = (meta_reference(meta["sd"], torch.from_numpy(tokens_BxS).long())[0] if which == "meta"
         else deepseek_reference(deepseek["sd"], torch.from_numpy(tokens_BxS).long())[0])
  np.testing.assert_allclose(_hf_logits(out, tokens_BxS), ref.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_to_hf_projection_heads_tied(make_config, make_model, tokens_BxS, tmp_path):
  """Projection heads: head 1 is the trunk, so the export is trunk + final norm (tied here)."""
  c = make_config("projection", 3)
  c.model.vocab_size = 259  # the byte tokenizer's
  model, params = make_model(c)
  wd, out = str(tmp_path / "wd"), str(tmp_path / "hf")
  convert.write_workdir(wd, c, params)
  assert convert.main(["to-hf", "--workdir", wd, "--out", out]) == 0
  h_NxBxSxD, _ = model.apply({"params": params}, tokens_BxS)
  ours_BxSxV = np.asarray(logits(params, model.args, h_NxBxSxD))[0]
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["tie_word_embeddings"] is True
  np.testing.assert_allclose(_hf_logits(out, tokens_BxS), ours_BxSxV, atol=1e-4, rtol=1e-4)


def test_meta_bfloat16_storage(meta, spm_path, tmp_path):
  out = str(tmp_path / "bf16")
  convert.import_meta(meta["ckpt"], out, tokenizer=spm_path, max_len=64, dtype="bfloat16")
  loaded = generate.load_workdir(out)
  a = np.asarray(loaded.params["heads"]["blocks"]["feed_forward"]["w2"]["kernel"])
  b = np.asarray(meta["loaded"].params["heads"]["blocks"]["feed_forward"]["w2"]["kernel"])
  assert a.dtype == np.float32
  np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)
  assert not np.array_equal(a, b)


class Gadget:  # pickled by reference: torch.load(weights_only=True) must refuse it
  pass


def test_meta_errors(spm_path, tmp_path, capsys):
  sd = _meta_state()
  ckpt = _save_meta(tmp_path / "pickled", {})
  torch.save({"tok_embeddings.weight": torch.zeros(2), "x": Gadget()},
             os.path.join(ckpt, "consolidated.00.pth"))
  assert convert.main(["meta", "--ckpt", ckpt, "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert "consolidated.00.pth needs pickled code" in err and len(err.strip().splitlines()) == 1

  missing = dict(sd)
  del missing["extra_heads.1.feed_forward.w3.weight"]
  with pytest.raises(ValueError, match=r"no tensor 'extra_heads.1.feed_forward.w3.weight' "
                     r"\(expected shape \(224, 64\)"):
    convert.import_meta(_save_meta(tmp_path / "missing", missing), str(tmp_path / "o"),
                        tokenizer=spm_path)

  bad = dict(sd, **{"layers.1.attention.wk.weight": torch.zeros(48, D)})
  with pytest.raises(ValueError, match=r"'layers.1.attention.wk.weight' has shape \(48, 64\), "
                     r"expected \(32, 64\)"):
    convert.import_meta(_save_meta(tmp_path / "bad", bad), str(tmp_path / "o"),
                        tokenizer=spm_path)

  extra = dict(sd, **{"extra_heads.2.ffn_norm.weight": torch.ones(D)})
  with pytest.raises(ValueError, match="unexpected tensor 'extra_heads.2.ffn_norm.weight'"):
    convert.import_meta(_save_meta(tmp_path / "extra", extra), str(tmp_path / "o"),
                        tokenizer=spm_path)
  with pytest.raises(ValueError, match="byte tokenizer has 259 ids.*no tokenizer.model or "
                     "tokenizer.json, name one"):
    convert.import_meta(_save_meta(tmp_path / "extra", sd), str(tmp_path / "o"))
  assert not os.path.exists(tmp_path / "o")  # nothing written on a refused checkpoint


def test_deepseek_refuses_moe_mla_and_rope_scaling(tmp_path):
  sd = _deepseek_state()
  moe = dict(sd, **{"model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(8, D)})
  with pytest.raises(ValueError, match="mlp.experts.0.gate_proj.weight.*Mixture-of-Experts.*"
                     "dense Llama-style"):
    convert.import_deepseek(_save_deepseek(tmp_path / "moe", moe), str(tmp_path / "o"))
  with pytest.raises(ValueError, match="Mixture-of-Experts.*dense Llama-style"):
    convert.import_deepseek(_save_deepseek(tmp_path / "moe_cfg", sd,
                                           dict(DS_CONFIG, n_routed_experts=8)),
                            str(tmp_path / "o"))
  with pytest.raises(ValueError, match="rope_scaling.mscale: DeepSeek's yarn mscale"):
    convert.import_deepseek(_save_deepseek(tmp_path / "yarn", sd, dict(
        DS_CONFIG, rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0,
                                 "mscale_all_dim": 1.0})), str(tmp_path / "o"))
  mla = dict(sd, **{"model.layers.0.self_attn.kv_a_proj_with_mqa.weight": torch.zeros(8, D)})
  with pytest.raises(ValueError, match="MLA attention.*dense Llama-style"):
    convert.import_deepseek(_save_deepseek(tmp_path / "mla", mla), str(tmp_path / "o"))
