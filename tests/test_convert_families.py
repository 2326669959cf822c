"""`convert from-hf` / `to-hf` for the families people fine-tune: tiny random Llama 3 (llama3
RoPE scaling), Qwen2 (q/k/v biases, tied embeddings), Qwen3 (q/k norms, head_dim 16 != 32 / 4)
and Mistral (a 4-token sliding window) built here with transformers, each with a tokenizer.json
only (a byte-level BPE trained here with `tokenizers`). Head 1 equals transformers' logits,
greedy decoding equals its `generate`, the export loads in transformers as the same family with
the same logits, and the workdir carries its tokenizer (it still decodes after a move)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import require

torch = require("torch")
transformers = require("transformers")
tokenizers_lib = require("tokenizers")

from mtp_jax import config as config_lib  # noqa: E402
from mtp_jax import convert, generate  # noqa: E402
from mtp_jax.decoding import decode as decode_lib  # noqa: E402
from mtp_jax.data import tokenizers  # noqa: E402
from mtp_jax.model import logits  # noqa: E402

V, D, LAYERS, S = 320, 32, 3, 12
TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n",
         "class Point:\n    x: int = 0\n    y: int = 0\n"] * 20
SIZES = dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5)
FAMILIES = {  # family: (config class, model class, extra config, head kind)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=16)), "parallel"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), "projection"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=False),
              "sequential"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4,
                                                            tie_word_embeddings=False),
                "parallel"),
}


def train_bpe(folder, *, bos_template: bool) -> str:
  """A byte-level BPE (every text encodes) with <s>, </s>, <pad>; Llama 3 style: its template
  puts <s> first."""
  from tokenizers import (
      decoders, models, pre_tokenizers, processors, trainers)
  tok = tokenizers_lib.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if bos_template:
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  os.makedirs(folder, exist_ok=True)
  tok.save(os.path.join(folder, "tokenizer.json"))
  return str(folder)


def make_hf(folder, family: str) -> str:
  cfg_cls, model_cls, extra, _ = FAMILIES[family]
  torch.manual_seed(len(family))
  specials = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
  if family.startswith("qwen"):
    specials["bos_token_id"] = None  # Qwen's tokenizers have no bos
  cfg = getattr(transformers, cfg_cls)(**SIZES, **extra, **specials)
  model = getattr(transformers, model_cls)(cfg)
  with torch.no_grad():  # far from HF's 0.02 init: biases and norm scales not 0 / 1
    for name, p in model.named_parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name
              else 0.3 * torch.randn_like(p) if name.endswith("bias")
              else torch.randn_like(p) / D**0.5)
  model.save_pretrained(folder)
  train_bpe(folder, bos_template=family == "llama")
  assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json",
                                        "model.safetensors", "tokenizer.json"]
  return str(folder)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, tmp_path_factory):
  family = request.param
  root = tmp_path_factory.mktemp(family)
  ckpt = make_hf(root / "hf", family)
  out = str(root / "wd")
  assert convert.main(["from-hf", "--ckpt", ckpt, "--out", out, "--n_future", "2",
                       "--heads", FAMILIES[family][3]]) == 0
  hf = getattr(transformers, FAMILIES[family][1]).from_pretrained(ckpt, dtype=torch.float32)
  return family, ckpt, out, hf.eval(), root


@pytest.mark.slow
def test_head1_and_generate_equal_transformers(imported):
  family, ckpt, out, hf, _ = imported
  loaded = generate.load_workdir(out)
  a, tok = loaded.model.args, loaded.tokenizer
  assert isinstance(tok, tokenizers.HFTokenizer) and a.family == family
  assert (a.qkv_bias, a.qk_norm, a.head_dim, a.sliding_window, a.rope_scaling) == (
      family == "qwen2", family == "qwen3", 16 if family == "qwen3" else 8,
      4 if family == "mistral" else 0, "llama3" if family == "llama" else "none")
  tokens_BxS = np.random.default_rng(0).integers(0, V, (2, S)).astype(np.int32)
  h_NxBxSxD, _ = loaded.model.apply({"params": loaded.params}, tokens_BxS)
  ours = np.asarray(logits(loaded.params, a, h_NxBxSxD))[0]
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens_BxS).long()).logits.numpy()
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)

  prompts = [tok.encode(t, add_bos=tok.prompt_bos) for t in ("def add(a", "for i in r")]
  assert tok.prompt_bos == (family == "llama")
  assert list(generate.encode_prompts(tok, ["def add(a"])[0]) == list(prompts[0])  # bos as HF
  n = min(len(p) for p in prompts)
  prompts_BxP = np.stack([p[:n] for p in prompts])
  ours = decode_lib.plain(loaded.params, a, list(prompts_BxP), max_new_tokens=10,
                           eos_id=tok.eos_id, pad_id=tok.pad_id)
  with torch.no_grad():
    ref = hf.generate(torch.from_numpy(prompts_BxP).long(), max_new_tokens=10, do_sample=False,
                      eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)[:, n:].numpy()
  for b in range(len(prompts_BxP)):
    m = int(ours.lengths[b])
    assert m >= 1
    np.testing.assert_array_equal(ours.tokens[b, :m], ref[b, :m])


@pytest.mark.slow
def test_export_is_the_same_family_with_the_same_logits(imported):
  family, ckpt, out, hf, root = imported
  back = str(root / "back")
  assert convert.main(["to-hf", "--workdir", out, "--out", back]) == 0
  with open(os.path.join(back, "config.json")) as f:
    cfg = json.load(f)
  assert (cfg["architectures"], cfg["model_type"]) == ([FAMILIES[family][1]], family)
  model = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
  assert type(model).__name__ == FAMILIES[family][1]
  tokens = torch.from_numpy(np.random.default_rng(2).integers(0, V, (2, S))).long()
  with torch.no_grad():
    np.testing.assert_allclose(model(tokens).logits.numpy(), hf(tokens).logits.numpy(),
                               atol=1e-5, rtol=1e-5)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(back, "tokenizer.json"))
  assert fast.encode("x = 1", add_special_tokens=False) == list(
      tokenizers.HFTokenizer(back).encode("x = 1"))


def test_workdir_carries_its_tokenizer(imported):
  """config.json names the workdir's own tokenizer.json by a relative path: a moved workdir
  loads and decodes, with the same special ids."""
  family, ckpt, out, _, root = imported
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["data"]["hf_tokenizer"] == "tokenizer.json"
  moved = str(root / "moved")
  shutil.copytree(out, moved)
  before = tokenizers.get_tokenizer(config_lib.load_json(os.path.join(out, "config.json")).data)
  shutil.rmtree(os.path.join(ckpt))  # the source checkpoint is gone too
  loaded = generate.load_workdir(moved)
  tok = loaded.tokenizer
  assert tok.path == os.path.join(moved, "tokenizer.json")
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.has_bos) == (
      before.bos_id, before.eos_id, before.pad_id, family not in ("qwen2", "qwen3"))
  text = "def add(a, b):\n    return a + b\n"
  assert tok.decode(tok.encode(text, add_bos=True, add_eos=True)) == text
