"""`convert from-gguf` on GGUF files written here with llama.cpp's own `gguf` package: a tiny
random Llama (transformers) saved as llama.cpp's converter saves it (its tensor names from
gguf's name table, q/k rows permuted for llama.cpp's interleaved RoPE, a GPT-2 byte-level BPE in
the metadata), some tensors quantized (Q8_0, Q4_1, F16). Head 1 equals transformers'
`from_pretrained(gguf_file=...)` logits and greedy `generate`; the tokenizer encodes as
transformers' GGUF tokenizer; bad files are one `error:` line with nothing written. The real
SmolLM2 file is tests/integration/test_smollm2.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import require

torch = require("torch")
transformers = require("transformers")
gguf = require("gguf")
require("tokenizers")

from mtp_jax import convert, generate  # noqa: E402
from mtp_jax.decoding import decode as decode_lib  # noqa: E402
from mtp_jax.model import logits  # noqa: E402
from test_convert_families import TEXTS, train_bpe  # noqa: E402

D, LAYERS, HEADS, KV = 64, 2, 4, 2
QUANT = {"token_embd.weight": "Q8_0", "blk.0.ffn_up.weight": "Q4_1",
         "blk.1.attn_q.weight": "F16"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf LlamaModel.permute: rotate-half RoPE rows to interleaved."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def write_gguf(path, *, arch: str = "llama", quant=None, bad_type: bool = False,
               context: int = 64):
  """A tiny random Llama as a GGUF file at `path`; returns the transformers model holding the
  weights written (before quantization)."""
  import json
  tok_dir = train_bpe(os.path.join(os.path.dirname(path), "bpe"), bos_template=False)
  with open(os.path.join(tok_dir, "tokenizer.json")) as f:
    bpe = json.load(f)["model"]
  # GPT-2's <|endoftext|> last, as unk: transformers' GPT-2 tokenizer adds it where it is missing
  vocab = sorted(bpe["vocab"], key=bpe["vocab"].get) + ["<|endoftext|>"]
  V = len(vocab)
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=128,
                                 num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                 num_key_value_heads=KV, max_position_embeddings=context,
                                 rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0,
                                 eos_token_id=1, pad_token_id=2,
                                 rope_parameters=dict(rope_type="default", rope_theta=5000.0))
  model = transformers.LlamaForCausalLM(cfg)
  names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_name("tiny-llama-test")
  w.add_context_length(context)
  w.add_embedding_length(D)
  w.add_block_count(LAYERS)
  w.add_feed_forward_length(128)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_freq_base(5000.0)
  w.add_vocab_size(V)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  w.add_token_list(vocab)
  w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (V - 4)
                    + [gguf.TokenType.CONTROL])
  w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
  w.add_bos_token_id(0)
  w.add_eos_token_id(1)
  w.add_pad_token_id(2)
  w.add_unk_token_id(V - 1)
  w.add_add_bos_token(False)
  w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  quant = QUANT if quant is None else quant
  with torch.no_grad():
    for i, (hf_name, p) in enumerate(model.state_dict().items()):
      if hf_name == "lm_head.weight":  # tied: the embedding (llama.cpp writes no output.weight)
        continue
      rng = np.random.default_rng(i)
      x = (1 + 0.2 * rng.standard_normal(p.shape) if "norm" in hf_name
           else rng.standard_normal(p.shape) / np.sqrt(D)).astype(np.float32)
      p.copy_(torch.from_numpy(x))
      if hf_name.endswith("q_proj.weight"):
        x = permute(x, HEADS)
      if hf_name.endswith("k_proj.weight"):
        x = permute(x, KV)
      name = names.get_name(hf_name[:-len(".weight")]) + ".weight"
      kind = quant.get(name, "F32")
      if bad_type and name == "blk.1.ffn_down.weight":
        kind = "Q8_1"
      qtype = gguf.GGMLQuantizationType[kind]
      if kind == "F32":
        w.add_tensor(name, x)
      elif kind == "F16":
        w.add_tensor(name, x.astype(np.float16))
      elif kind == "Q8_1":  # written as raw blocks of its size; gguf cannot dequantize it
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
      else:
        q = gguf.quants.quantize(x, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return model.eval()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  root = tmp_path_factory.mktemp("gguf")
  path = str(root / "tiny.gguf")
  write_gguf(path)
  return path, root


def _hf(path):
  folder, name = os.path.split(path)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=torch.float32).eval()
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  return model, tok


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parallel", "sequential"])
def test_head1_tokens_and_tokenizer_equal_transformers(tiny_gguf, kind):
  path, root = tiny_gguf
  out = str(root / f"wd_{kind}")
  assert convert.main(["from-gguf", "--gguf", path, "--out", out, "--n_future", "2",
                       "--heads", kind]) == 0
  assert sorted(os.listdir(out)) == ["chat_template.jinja", "checkpoints", "config.json",
                                     "tokenizer.json", "tokenizer_config.json"]
  hf, hf_tok = _hf(path)
  loaded = generate.load_workdir(out)
  a, tok = loaded.model.args, loaded.tokenizer
  for text in TEXTS[:3] + ["x  =\t'héllo' # ünïcode 你好\n\n"]:
    assert list(tok.encode(text)) == hf_tok.encode(text, add_special_tokens=False)
    assert list(tok.encode(text, add_bos=tok.prompt_bos)) == hf_tok.encode(text)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
  tokens_BxS = np.random.default_rng(0).integers(0, a.vocab_size, (2, 12)).astype(np.int32)
  h_NxBxSxD, _ = loaded.model.apply({"params": loaded.params}, tokens_BxS)
  ours = np.asarray(logits(loaded.params, a, h_NxBxSxD))[0]
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens_BxS).long()).logits.numpy()
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
  prompt = tok.encode("def add(a")
  ours = decode_lib.plain(loaded.params, a, [prompt], max_new_tokens=8, eos_id=-1,
                          pad_id=tok.pad_id)
  with torch.no_grad():
    ref = hf.generate(torch.from_numpy(prompt[None]).long(), max_new_tokens=8, do_sample=False,
                      eos_token_id=None, pad_token_id=tok.pad_id)[0, len(prompt):].numpy()
  np.testing.assert_array_equal(ours.tokens[0, :8], ref)


@pytest.mark.slow
def test_f32_file_equals_the_model_it_was_written_from(tmp_path):
  """Every tensor F32: head 1 is the transformers model the file was written from, so llama.cpp's
  q/k permutation is undone and every name lands where it belongs (not only transformers'
  reading of the same file)."""
  path = str(tmp_path / "f32.gguf")
  model = write_gguf(path, quant={})
  out = str(tmp_path / "wd")
  assert convert.main(["from-gguf", "--gguf", path, "--out", out, "--n_future", "3",
                       "--heads", "projection"]) == 0
  loaded = generate.load_workdir(out)
  a = loaded.model.args
  tokens_BxS = np.random.default_rng(1).integers(0, a.vocab_size, (2, 12)).astype(np.int32)
  h_NxBxSxD, _ = loaded.model.apply({"params": loaded.params}, tokens_BxS)
  with torch.no_grad():
    ref = model(torch.from_numpy(tokens_BxS).long()).logits.numpy()
  np.testing.assert_allclose(np.asarray(logits(loaded.params, a, h_NxBxSxD))[0], ref, atol=1e-4,
                             rtol=1e-4)
  # heads 2..3 start as copies (projection: identity MLPs), predicting what head 1 predicts
  np.testing.assert_allclose(np.asarray(logits(loaded.params, a, h_NxBxSxD))[2], ref, atol=1e-4,
                             rtol=1e-4)


def _error(capsys, argv) -> str:
  assert convert.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --gguf: "), err
  return err[0]


def test_bad_files_are_one_line_and_write_nothing(tiny_gguf, tmp_path, capsys):
  path, root = tiny_gguf
  out = str(tmp_path / "wd")
  args = ["--out", out, "--n_future", "2", "--heads", "parallel"]
  assert "no file at" in _error(capsys, ["from-gguf", "--gguf", str(tmp_path / "x.gguf")] + args)
  cut = str(tmp_path / "cut.gguf")
  with open(path, "rb") as f, open(cut, "wb") as g:
    g.write(f.read()[:os.path.getsize(path) // 2])
  assert "not a readable GGUF file" in _error(capsys, ["from-gguf", "--gguf", cut] + args)
  text = str(tmp_path / "text.gguf")
  with open(text, "w") as f:
    f.write("not a gguf file\n")
  assert "not a readable GGUF file" in _error(capsys, ["from-gguf", "--gguf", text] + args)
  other = str(tmp_path / "other.gguf")
  write_gguf(other, arch="gpt2")
  assert "general.architecture 'gpt2'; from-gguf reads 'llama'" in _error(
      capsys, ["from-gguf", "--gguf", other] + args)
  bad = str(tmp_path / "q81.gguf")
  write_gguf(bad, bad_type=True)
  assert "tensor 'blk.1.ffn_down.weight' is Q8_1" in _error(
      capsys, ["from-gguf", "--gguf", bad] + args)
  assert not os.path.exists(out)
