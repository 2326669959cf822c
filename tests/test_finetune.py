"""Adding heads to a pretrained model: `convert from-hf` on a tiny random transformers
LlamaForCausalLM (tied and untied, GQA, sharded) against transformers' own forward and
`generate`, the round trip back through `to-hf`, heads-only fine-tuning from the import
(`train.init_from`, `optim.trainable = "heads"`), and the one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import numpy as np
import pytest
from conftest import copy_code_corpus, require

torch = require("torch")
transformers = require("transformers")
from flax.traverse_util import flatten_dict  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from mtp_jax import config as config_lib  # noqa: E402
from mtp_jax.config import validation  # noqa: E402
from mtp_jax import convert, generate, train  # noqa: E402
from mtp_jax.decoding import decode as decode_lib  # noqa: E402
from mtp_jax import loss as loss_lib  # noqa: E402
from mtp_jax import optimizer as optim_lib  # noqa: E402
from mtp_jax.data import pipeline  # noqa: E402
from mtp_jax.model import logits  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, D, LAYERS, S = 259, 32, 3, 12  # vocab: the byte tokenizer's (the checkpoints ship none)
PROMPTS = np.random.default_rng(1).integers(0, 256, (2, 5))


def make_hf(folder, *, tied: bool, seed: int, shard: bool) -> str:
  """A random LlamaForCausalLM with GQA; weights ~ N(0, 1/d) and norms ~ 1 + N(0, 0.2^2), not
  HF's 0.02 init, so logits are far from uniform and greedy decoding is not degenerate."""
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(
      vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=LAYERS,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=tied)
  model = transformers.LlamaForCausalLM(cfg)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / D**0.5)
  model.save_pretrained(folder, max_shard_size="40KB" if shard else "10GB")
  return str(folder)


def hf_model(folder):
  model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
  return model.eval()


def hf_tensors(folder) -> dict:
  out = {}
  for name in os.listdir(folder):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(folder, name)))
  return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  return {"untied": make_hf(root / "untied", tied=False, seed=0, shard=True),
          "tied": make_hf(root / "tied", tied=True, seed=1, shard=False)}


@pytest.mark.parametrize("kind,tied", [("parallel", "untied"), ("projection", "tied"),
                                       ("sequential", "untied")])
@pytest.mark.slow
def test_head1_is_the_hf_model(kind, tied, ckpts, tmp_path):
  """Head 1's logits equal transformers' (f32, 1e-4), greedy decoding equals its `generate`
  token for token, and `copy` starts the new heads predicting what head 1 predicts."""
  ckpt, out = ckpts[tied], str(tmp_path / "wd")
  if tied == "untied":
    assert os.path.isfile(os.path.join(ckpt, "model.safetensors.index.json"))
  assert convert.main(["from-hf", "--ckpt", ckpt, "--out", out, "--n_future", "3",
                       "--heads", kind]) == 0
  loaded = generate.load_workdir(out)
  a = loaded.model.args
  assert (a.head_kind, a.n_future, a.n_kv_heads, a.tie_embeddings) == (kind, 3, 2,
                                                                       tied == "tied")
  assert a.n_trunk == (LAYERS - 1 if kind == "parallel" else LAYERS)
  tokens_BxS = np.random.default_rng(0).integers(0, V, (2, S)).astype(np.int32)
  h_NxBxSxD, _ = loaded.model.apply({"params": loaded.params}, tokens_BxS)
  ours_NxBxSxV = np.asarray(logits(loaded.params, a, h_NxBxSxD))
  hf = hf_model(ckpt)
  with torch.no_grad():
    ref_BxSxV = hf(torch.from_numpy(tokens_BxS).long()).logits.numpy()
  np.testing.assert_allclose(ours_NxBxSxV[0], ref_BxSxV, atol=1e-4, rtol=1e-4)
  if kind != "sequential":  # exact copies of head 1 (sequential: up to a temperature)
    np.testing.assert_array_equal(ours_NxBxSxV[1], ours_NxBxSxV[0])
  agree = (ours_NxBxSxV[2].argmax(-1) == ours_NxBxSxV[0].argmax(-1)).mean()
  assert agree > 0.9, agree

  tok = loaded.tokenizer
  ours = decode_lib.plain(loaded.params, a, list(PROMPTS), max_new_tokens=6,
                           eos_id=tok.eos_id, pad_id=tok.pad_id)
  with torch.no_grad():
    ref = hf.generate(torch.from_numpy(PROMPTS).long(), max_new_tokens=6, do_sample=False,
                      eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)[:, PROMPTS.shape[1]:]
  for b in range(len(PROMPTS)):
    n = int(ours.lengths[b])
    assert n >= 1
    np.testing.assert_array_equal(ours.tokens[b, :n], ref[b, :n].numpy())


@pytest.mark.slow
def test_round_trip_gives_the_original_tensors(ckpts, tmp_path):
  for tied in ("untied", "tied"):
    wd, back = str(tmp_path / f"wd_{tied}"), str(tmp_path / f"hf_{tied}")
    convert.import_hf(ckpts[tied], wd, n_future=4, heads="parallel", init_heads="random")
    assert convert.main(["to-hf", "--workdir", wd, "--out", back]) == 0
    orig, got = hf_tensors(ckpts[tied]), hf_tensors(back)
    assert sorted(got) == sorted(orig)
    for name, x in orig.items():
      np.testing.assert_array_equal(got[name], x, err_msg=name)
    with open(os.path.join(ckpts[tied], "config.json")) as f:
      a = json.load(f)
    with open(os.path.join(back, "config.json")) as f:
      b = json.load(f)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings"):
      assert a[key] == b[key], key


def _finetune_config(imported, corpus, steps):
  """configs/finetune.py:IMPORTED (as --config passes it) on a tiny text_folder corpus."""
  spec = importlib.util.spec_from_file_location("finetune_cfg",
                                                os.path.join(ROOT, "configs/finetune.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(imported)
  c.data.corpus, c.data.folder, c.data.dir = "text_folder", corpus["folder"], corpus["data_dir"]
  c.data.val_percent, c.data.seq_len = 20, 32
  c.train.steps, c.train.batch_size, c.train.log_every = steps, 4, 1
  c.train.eval_every = c.train.checkpoint_every = steps
  c.train.eval_batches, c.train.async_checkpoints = 1, False
  c.optim.lr, c.optim.warmup_steps = 1e-2, 1
  c.model.remat_policy = "none"
  return validation.validate(c)


@pytest.mark.slow
def test_heads_only_finetuning(ckpts, tmp_path, capsys):
  """Parallel heads, the hard case: head 1's block shares a stacked leaf with the new heads."""
  imported, run = str(tmp_path / "imported"), str(tmp_path / "run")
  convert.import_hf(ckpts["untied"], imported, n_future=3, heads="parallel")
  corpus = copy_code_corpus(tmp_path)
  c = _finetune_config(imported, corpus, steps=8)
  train.check_inputs(c, run)
  summary = train.train(c, run)
  assert summary["step"] == 8
  before, after = generate.load_workdir(imported), generate.load_workdir(run)
  flat = lambda p: {"/".join(k): np.asarray(v) for k, v in flatten_dict(p).items()}
  p0, p1 = flat(before.params), flat(after.params)
  assert sorted(p0) == sorted(p1)
  bits = lambda x: np.ascontiguousarray(x).tobytes()  # bit-identical, signed zeros included
  for name in p0:
    if name.startswith("heads/blocks/"):
      assert bits(p1[name][0]) == bits(p0[name][0]), name  # head 1's block
      assert not np.array_equal(p1[name][1:], p0[name][1:]), name
    else:
      assert bits(p1[name]) == bits(p0[name]), name

  batch = next(iter(pipeline.make_iterator(c, "validation", repeat=False)))
  m0 = loss_lib.model_loss(before.params, before.model, c, batch)[1]["head_loss"]
  m1 = loss_lib.model_loss(after.params, after.model, c, batch)[1]["head_loss"]
  np.testing.assert_array_equal(np.asarray(m1)[0], np.asarray(m0)[0])
  assert np.all(np.asarray(m1)[1:] < np.asarray(m0)[1:] - 0.1), (m0, m1)

  report = generate.run(run, ["def f(x):", "import o"], max_new_tokens=8, mode="both",
                        heads=None, out=open(os.devnull, "w"))
  assert report["identical"] and report["heads"] == 3

  c.train.steps = 10  # a workdir with checkpoints resumes: init_from is ignored
  capsys.readouterr()
  assert train.train(c, run)["step"] == 10
  assert "resuming at step 8/10" in capsys.readouterr().out


def test_errors_are_one_line_and_write_nothing(ckpts, tmp_path, capsys):
  out = str(tmp_path / "o")

  def refused(folder, *flags, match):
    assert convert.main(["from-hf", "--ckpt", str(folder), "--out", out, "--n_future", "2",
                         "--heads", "parallel", *flags]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("warning: ")]  # no tokenizer.model: the byte tokenizer
    assert len(err) == 1 and match in err[0], err
    assert not os.path.exists(out)

  def copy_ckpt(name, edit_config=None, drop=()):
    dst = tmp_path / name
    dst.mkdir()
    for f in os.listdir(ckpts["untied"]):
      if f in drop:
        continue
      text = open(os.path.join(ckpts["untied"], f), "rb").read()
      if f == "config.json" and edit_config:
        text = json.dumps(edit_config(json.loads(text))).encode()
      (dst / f).write_bytes(text)
    return dst

  moe = copy_ckpt("moe", lambda c: dict(c, model_type="qwen2_moe",
                                        architectures=["Qwen2MoeForCausalLM"]))
  refused(moe, match="config.json architectures: Qwen2MoeForCausalLM (model_type 'qwen2_moe'); "
          "from-hf reads LlamaForCausalLM, Qwen2ForCausalLM")
  shards = sorted(f for f in os.listdir(ckpts["untied"]) if f.endswith(".safetensors"))
  refused(copy_ckpt("missing", drop=(shards[-1],)),
          match=f"shard '{shards[-1]}', named in model.safetensors.index.json, is not in")
  refused(copy_ckpt("wide", lambda c: dict(c, intermediate_size=96)),
          match="'model.layers.0.mlp.gate_proj.weight' has shape (64, 32), expected (96, 32)")
  refused(copy_ckpt("dynamic", lambda c: dict(c, rope_parameters={"rope_type": "dynamic",
                                                                   "factor": 4.0})),
          match="config.json rope_parameters.rope_type: 'dynamic'; mtp_jax has default")
  refused(copy_ckpt("o_bias", lambda c: dict(c, attention_bias=True)),
          match="config.json attention_bias: biases on o_proj")
  bpe = copy_ckpt("bpe")
  (bpe / "tokenizer.json").write_text("{}")
  refused(bpe, match="--tokenizer: cannot read")
  refused(ckpts["untied"], "--init_heads", "zero", match="--init_heads")
  assert convert.main(["from-hf", "--ckpt", ckpts["untied"], "--out", out, "--n_future", "1",
                       "--heads", "parallel"]) == 2
  assert "--n_future: must be >= 2" in capsys.readouterr().err and not os.path.exists(out)

  c = config_lib.base_config()
  c.optim.trainable = "heads"
  with pytest.raises(ValueError, match=r"^config.optim.trainable: 'heads' trains heads 2..n "
                     r"and model.n_future is 1"):
    validation.validate(c)


def test_init_from_checks_the_model(ckpts, tmp_path):
  imported = str(tmp_path / "imported")
  convert.import_hf(ckpts["tied"], imported, n_future=2, heads="projection")
  c = config_lib.load_json(os.path.join(imported, "config.json"))
  c.train.init_from = imported
  train.check_inputs(c, str(tmp_path / "run"))  # the import's own model: fine
  c.model.n_future = 3
  with pytest.raises(ValueError, match=r"^config.train.init_from: .* holds another model "
                     r"\(param heads/mlps/down/kernel: \(1, 64, 32\) there, \(2, 64, 32\) here"):
    train.check_inputs(c, str(tmp_path / "run"))
  c.model.n_future, c.train.init_from = 2, str(tmp_path / "nothing")
  with pytest.raises(ValueError, match="is not a workdir with config.json and checkpoints/"):
    train.check_inputs(c, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parallel", "projection", "sequential"])
def test_heads_only_allocates_no_state_for_frozen_params(kind, make_config, make_model):
  """Adam moments exist for the stacks holding heads 2..n and nothing else (parallel: the whole
  blocks stack, head 1's slot included, since it shares the leaves); an update moves heads
  2..n only, whatever the gradients of the rest."""
  c = make_config(kind, 3)
  c.optim.trainable, c.optim.warmup_steps = "heads", 0
  _, params = make_model(validation.validate(c))
  tx = optim_lib.make_optimizer(c)
  state = tx.init(params)
  stack = {"parallel": "blocks", "projection": "mlps", "sequential": "depths"}[kind]
  n_stack = sum(x.size for x in jax.tree.leaves(params["heads"][stack]))
  n_state = sum(x.size for x in jax.tree.leaves(state) if x.ndim)
  assert n_state == 2 * n_stack  # mu and nu of the trained stack only
  grads = jax.tree.map(lambda x: np.ones_like(x), params)
  updates, _ = tx.update(grads, state, params)
  for path, u in flatten_dict(updates).items():
    u = np.asarray(u)
    if path[:2] == ("heads", stack):
      moved = u[1:] if kind == "parallel" else u
      assert np.all(moved != 0), path
      if kind == "parallel":
        assert np.all(u[0] == 0), path
    else:
      assert not np.any(u), path


def test_zero_update_keeps_signed_zeros():
  """optax.apply_updates would turn a frozen -0.0 into +0.0 (p + 0.0)."""
  from mtp_jax import steps
  p = {"w": np.array([-0.0, 1.0, -2.0], np.float32)}
  u = {"w": np.array([0.0, 0.5, 0.0], np.float32)}
  out = np.asarray(steps.apply_updates(p, u)["w"])
  assert out.tobytes() == np.array([-0.0, 1.5, -2.0], np.float32).tobytes()
