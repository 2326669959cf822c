"""The base config (every field, defaulting to plain next-token prediction), its validation, and
`ModelArgs`, the model's hashable hyper-parameters generated from `config.model`.

Files in `configs/` import `base_config()` and change what they need; the train and generate
entry points call `validate()` once, after command-line overrides, so a bad value is one clear
`ValueError` at start-up, never a shape error deep inside a jitted function.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax.numpy as jnp
import ml_collections

from mtp_jax import attention
from mtp_jax import family_checks
from mtp_jax import heads
from mtp_jax.data import config_checks as data_checks
from mtp_jax.sharding import DISTRIBUTED_MODES

HEAD_KINDS = tuple(heads.KINDS)  # the built-in kinds; validate() reads the live registry
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
HEAD_WEIGHTS = ("uniform", "geometric", "deepseek")
SCHEDULES = ("cosine", "linear", "constant")
TRAINABLE = ("all", "heads")  # optim.trainable: "heads" trains heads 2..n only (optimizer.py)
DTYPES = ("float32", "bfloat16")
# Every float field: (the allowed range in words, the test). validate() checks each value is a
# finite number in range (nan fails no `<` test); tests/test_config.py fails for a float field
# missing here.
FLOAT_RANGES = {
    "model.rope_theta": ("> 0", lambda x: x > 0),
    "model.norm_eps": ("> 0", lambda x: x > 0),
    "model.rope_factor": (">= 1", lambda x: x >= 1),
    "model.rope_low_freq_factor": ("> 0", lambda x: x > 0),
    "model.rope_high_freq_factor": ("> 0", lambda x: x > 0),
    "model.rope_beta_fast": ("> 0", lambda x: x > 0),
    "model.rope_beta_slow": ("> 0", lambda x: x > 0),
    "model.rope_attention_factor": (">= 0 (0: from rope_factor)", lambda x: x >= 0),
    "loss.geometric_decay": ("in (0, 1]", lambda x: 0 < x <= 1),
    "loss.mtp_lambda": (">= 0", lambda x: x >= 0),
    "loss.z_loss": (">= 0", lambda x: x >= 0),
    "optim.lr": ("> 0", lambda x: x > 0),
    "optim.min_lr_ratio": ("in [0, 1]", lambda x: 0 <= x <= 1),
    "optim.b1": ("in [0, 1)", lambda x: 0 <= x < 1),
    "optim.b2": ("in [0, 1)", lambda x: 0 <= x < 1),
    "optim.eps": ("> 0", lambda x: x > 0),
    "optim.weight_decay": (">= 0", lambda x: x >= 0),
    "optim.grad_clip": (">= 0 (0: no clipping)", lambda x: x >= 0),
}


def base_config() -> ml_collections.ConfigDict:
  """Every field the code reads, with next-token-prediction defaults."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 259  # byte tokenizer: 256 bytes + pad, bos, eos
  # The embedding and unembedding have vocab_size rounded up to a multiple of this many rows
  # (ModelArgs.padded_vocab): 259 -> 384 splits over `tensor` and fills the MXU / tensor cores.
  # Pad logits are masked out of the loss and decoding (model.mask_pad_logits). A workdir saved
  # before the field existed loads with 1 (load_json): its embedding is unpadded.
  c.model.vocab_multiple = 128
  c.model.d_model = 256
  c.model.n_layers = 6  # counts the parallel head blocks (matched parameters, Gloeckle §3)
  c.model.n_heads = 8  # attention heads
  c.model.n_kv_heads = 4
  c.model.d_ff = 768  # SwiGLU hidden size
  c.model.max_len = 1024  # longest sequence (prompt + completion) the model accepts
  c.model.rope_theta = 10000.0
  c.model.norm_eps = 1e-5
  c.model.tie_embeddings = True
  c.model.n_future = 1
  c.model.remat_policy = "none"
  c.model.scan_layers = True
  c.model.dtype = "float32"  # compute dtype; params stay float32
  c.model.attention_impl = "auto"  # mtp_jax/attention.py: auto, einsum, cpu, xla, cudnn, splash
  # Model families (layers.Attention; docs/finetuning_families.md): defaults are a plain Llama.
  c.model.qkv_bias = False  # biases on q, k, v (Qwen2)
  c.model.qk_norm = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
  c.model.head_dim = 0  # 0: d_model // n_heads; else its own size (Qwen3)
  c.model.sliding_window = 0  # > 0: a query sees the last this-many positions (Mistral)
  c.model.family = "llama"  # the HF architecture `convert to-hf` writes: llama qwen2 qwen3 mistral
  # RoPE scaling as transformers' modeling_rope_utils: none, linear, llama3, yarn.
  c.model.rope_scaling = "none"
  c.model.rope_factor = 1.0  # linear, llama3, yarn
  c.model.rope_low_freq_factor = 1.0  # llama3
  c.model.rope_high_freq_factor = 4.0  # llama3
  c.model.rope_original_max_len = 8192  # llama3, yarn: the pretraining context
  c.model.rope_beta_fast = 32.0  # yarn
  c.model.rope_beta_slow = 1.0  # yarn
  c.model.rope_attention_factor = 0.0  # yarn: 0 = 0.1 ln(rope_factor) + 1
  c.model.heads = ml_collections.ConfigDict()
  c.model.heads.kind = "parallel"
  # Parallel head blocks: "vmap" runs them side by side (fast on small models); "scan" runs one
  # at a time, so only one head's activations are alive (what large models need: plan_memory).
  c.model.heads.parallel_stack = "vmap"
  # Sequential heads (heads.SequentialHeads.presets: who does which). The preset sets the three
  # fields below unless "" (custom).
  c.model.heads.seq_preset = "deepseek_v3"
  c.model.heads.seq_concat = "emb_first"
  c.model.heads.seq_trunk_state = "post_norm"
  c.model.heads.seq_output_norm = "per_module"

  c.loss = ml_collections.ConfigDict()
  c.loss.token_chunks = 1  # token tiles per head inside the loss scan; 1 = whole head at once
  # "uniform", "geometric", "deepseek", or one weight per head: "1,0.5,0.5,0.5" (a string, so
  # it overrides from the command line; a Python list or tuple works too).
  c.loss.head_weights = "uniform"
  c.loss.geometric_decay = 0.5  # head i gets decay**(i-1)
  c.loss.mtp_lambda = 0.3  # DeepSeek-V3: main loss + lambda/D * sum of depth losses
  c.loss.z_loss = 0.0

  c.data = ml_collections.ConfigDict()
  c.data.corpus = "python_code"
  c.data.dir = os.path.join(os.path.expanduser("~"), ".cache", "mtp_jax", "datasets")
  c.data.folder = ""  # text_folder corpus: root folder
  c.data.glob = "**/*.py"  # text_folder corpus: files to take
  c.data.val_percent = 5  # validation split: files whose path hash falls below this percent
  c.data.tokenizer = "byte"
  c.data.spm_path = ""  # sentencepiece model file when tokenizer == "sentencepiece"
  c.data.hf_tokenizer = ""  # tokenizer.json (or its folder) when tokenizer == "hf"
  c.data.seq_len = 256
  c.data.shuffle_seed = 0
  c.data.worker_count = 0
  # True: a document that does not fit in the rest of a row starts the next one (padding).
  c.data.whole_docs = False
  # Synthetic tasks (Gloeckle et al. 2024 §4; data/tasks.py), generated from task_seed.
  c.data.task_seed = 0
  c.data.task_train_size = 50_000  # train examples
  c.data.task_eval_size = 1_000  # examples of each other split
  c.data.induction_len = 63  # letters per example (+ eos: 64 tokens)
  c.data.induction_pairs = 4  # distinct names per example
  c.data.induction_repeats = 3  # occurrences of each name
  c.data.poly_modulus = 7  # the ring F_p[X]/(X^d): p ...
  c.data.poly_degree = 5  # ... and d (a polynomial is d coefficients)
  c.data.poly_ops = "+-*"  # operations drawn, from POLY_OPS; the paper adds "o"
  c.data.poly_train_ops = 5  # train and validation: 1..poly_train_ops operations
  c.data.poly_ood_ops = 8  # test_ood: poly_train_ops+1..poly_ood_ops
  # Real corpora (data/corpora.py; README "Real corpora"). tfds: a dataset prepared as
  # array_record (`tfds build NAME --file_format=array_record`), read without TensorFlow.
  c.data.tfds_name = ""  # "name/config:version", e.g. "c4/en:3.0.1"
  c.data.tfds_data_dir = ""  # "" = TFDS_DATA_DIR or ~/tensorflow_datasets
  c.data.text_key = "text"  # the text feature; nested: "document/body" or "document.body"
  c.data.train_split = "train"  # tfds split strings: "train[:99%]"
  c.data.val_split = "validation"  # e.g. "train[99%:]" for a dataset without one
  # array_record: token shards written by `python -m mtp_jax.data.prepare`.
  c.data.files = ""  # glob of the shards, e.g. "~/corpora/code/tokens-*.array_record"
  c.data.val_files = ""  # "" = hold out every round(100 / val_percent)-th record

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 3e-3
  c.optim.schedule = "cosine"
  c.optim.warmup_steps = 50
  c.optim.min_lr_ratio = 0.1
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.1
  c.optim.decay_norms_and_embeddings = False
  c.optim.grad_clip = 1.0
  c.optim.max_consecutive_nonfinite = 10
  c.optim.trainable = "all"  # "heads": trunk, embeddings, norm, unembedding, head 1 frozen

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 16
  c.train.grad_accum = 1
  c.train.steps = 1000  # the schedule's length
  c.train.stop_at = 0  # > 0: stop (with a checkpoint) at this step; rerun to go on to `steps`
  c.train.log_every = 10
  c.train.eval_every = 200
  c.train.eval_batches = 4
  c.train.checkpoint_every = 200
  c.train.keep_checkpoints = 3
  c.train.async_checkpoints = True
  # A workdir (mtp_jax.convert's or a run's): start from its params with a fresh optimizer and
  # schedule; ignored once this run has checkpoints of its own (then it resumes).
  c.train.init_from = ""
  c.train.debug_nonfinite_steps = ()  # fault injection for tests: steps whose grads become NaN

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # -1 takes the devices the other axes leave
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  # jax.distributed.initialize(): "auto" on TPU pods, Slurm (SLURM_NTASKS > 1) or when
  # JAX_COORDINATOR_ADDRESS is set; "on" always; "off" never.
  c.mesh.distributed = "auto"
  # Logical axis name -> mesh axis (or None). Only sharding.py reads mesh names.
  c.mesh.rules = (
      ("batch", ("data", "fsdp")),
      ("vocab", "tensor"),
      ("embed", "fsdp"),
      ("mlp", "tensor"),
      ("heads", "tensor"),
      ("kv_heads", "tensor"),
      ("head_dim", None),
      ("layers", None),
      ("mtp_heads", None),
      ("norm", None),
      ("concat", None),
      ("seq", None),
  )
  return c


def _model_fields(m: ml_collections.ConfigDict) -> dict[str, Any]:
  """config.model flat, as ModelArgs names it: model.heads.kind is head_kind, the other
  model.heads fields keep their names (they carry their kind's prefix); lists become tuples."""
  flat = {k: v for k, v in m.items() if k != "heads"}
  flat.update({"head_kind" if k == "kind" else k: v for k, v in m.heads.items()})
  if len(flat) != len(m) - 1 + len(m.heads):
    raise RuntimeError("config.model: a model.heads field shadows a model field")
  return {k: tuple(v) if isinstance(v, list) else v for k, v in flat.items()}


def _model_args_from_config(cls, m: ml_collections.ConfigDict):
  """The ModelArgs of a validated `config.model` (fields it does not know are ignored)."""
  flat = _model_fields(m)
  flat.update(dtype=jnp.dtype(m.dtype), n_trunk=heads.KINDS[m.heads.kind].n_trunk(m),
              head_dim=m.head_dim or m.d_model // m.n_heads)
  return cls(**{f.name: flat[f.name] for f in dataclasses.fields(cls)})


# Hashable model hyper-parameters (a jit static argument), generated from base_config().model
# so that a model field is declared and defaulted once, above.
ModelArgs = dataclasses.make_dataclass(
    "ModelArgs",
    [(k, Any if k == "dtype" else type(v)) for k, v in _model_fields(base_config().model).items()]
    + [("n_trunk", int)],
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": "Every field of config.model, flat (model.heads.kind as head_kind), dtype as "
                   "a jnp dtype, head_dim resolved (d_model // n_heads when 0), and n_trunk: "
                   "the trunk blocks its head kind leaves.",
        "from_config": classmethod(_model_args_from_config),
        # Rows of the embedding (columns of the unembedding): ids >= vocab_size are padding.
        "padded_vocab": property(lambda self: data_checks.padded_vocab(self.vocab_size,
                                                           self.vocab_multiple)),
    })


def load_file(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file, loaded by path as config_flags does (configs/ is not a
  package: a variant file loads its base this way)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location(
      "mtp_jax_config_" + os.path.splitext(os.path.basename(path))[0], path)
  if spec is None or not os.path.isfile(path):
    raise ValueError(f"--config: cannot load {path!r}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def save_json(config: ml_collections.ConfigDict, path: str) -> None:
  """Writes the resolved config where `load_json` reads it (a workdir's config.json)."""
  with open(path, "w") as f:
    f.write(config.to_json_best_effort(indent=2))


def load_json(path: str) -> ml_collections.ConfigDict:
  """A config saved by a training run (workdir/config.json), on top of today's defaults so that
  a workdir from before a field existed still loads."""
  import json  # pylint: disable=import-outside-toplevel
  with open(path) as f:
    saved = json.load(f)
  c = base_config()
  if "vocab_multiple" not in saved.get("model", {}):
    c.model.vocab_multiple = 1  # saved before the field existed: an unpadded embedding

  def merge(dst, src):
    for key, value in src.items():
      if isinstance(value, dict) and key in dst and isinstance(dst[key], ml_collections.ConfigDict):
        merge(dst[key], value)
      else:
        dst[key] = value
  merge(c, saved)
  folder = os.path.dirname(os.path.abspath(path))
  for field in ("spm_path", "hf_tokenizer"):  # a workdir's own copy, by a relative name
    value = c.data[field]
    if value and not os.path.isabs(value) and os.path.exists(os.path.join(folder, value)):
      c.data[field] = os.path.join(folder, value)
  return c


def parse_head_weights(value):
  """A weight scheme's name, or the list of weights that `value` spells ("1,0.5" or [1, 0.5])."""
  if isinstance(value, (list, tuple)):
    return [float(w) for w in value]
  if value in HEAD_WEIGHTS:
    return value
  try:
    return [float(w) for w in str(value).strip("()[] ").split(",") if w.strip()]
  except ValueError:
    return value


def _fail(field: str, msg: str):
  raise ValueError(f"config.{field}: {msg}")


def _get(c, field: str):
  for part in field.split("."):
    c = getattr(c, part)
  return c


def _choice(c, field: str, allowed):
  value = _get(c, field)
  if value not in allowed:
    _fail(field, f"got {value!r}, allowed: {', '.join(map(repr, allowed))}")


def _validate_floats(c: ml_collections.ConfigDict) -> None:
  for field, (words, in_range) in FLOAT_RANGES.items():
    value = _get(c, field)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and in_range(value)):
      _fail(field, f"must be a finite number {words}, got {value!r}")


def _validate_heads(c: ml_collections.ConfigDict) -> None:
  """model.heads: a registered kind; every kind's own fields (whichever kind is chosen, so a
  typo in a saved config fails); then the chosen kind's own checks."""
  _choice(c, "model.heads.kind", tuple(heads.KINDS))
  for kind in heads.KINDS.values():
    kind.validate_fields(c.model.heads, base_config().model.heads, _fail)
  heads.KINDS[c.model.heads.kind].validate_config(c.model, _fail)


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks every field the code relies on; raises ValueError naming the field. Returns c."""
  m = c.model
  _validate_floats(c)
  _choice(c, "model.remat_policy", REMAT_POLICIES)
  _choice(c, "model.dtype", DTYPES)
  _choice(c, "model.attention_impl", attention.IMPLS)
  for field in ("vocab_size", "vocab_multiple", "d_model", "n_layers", "n_heads", "n_kv_heads",
                "d_ff", "max_len"):
    if int(getattr(m, field)) < 1:
      _fail(f"model.{field}", f"must be >= 1, got {getattr(m, field)}")
  if m.n_future < 1:
    _fail("model.n_future", f"must be >= 1, got {m.n_future}")
  _validate_heads(c)
  family_checks.validate_family(c, _fail, _choice)
  if m.n_heads % m.n_kv_heads:
    _fail("model.n_kv_heads", f"must divide model.n_heads ({m.n_heads}), got {m.n_kv_heads}")

  data_checks.validate_data(c, _fail, _choice)
  d = c.data

  lo = c.loss
  if lo.token_chunks < 1 or d.seq_len % lo.token_chunks:
    _fail("loss.token_chunks", f"must be >= 1 and divide data.seq_len ({d.seq_len}), got "
          f"{lo.token_chunks}")
  weights = parse_head_weights(lo.head_weights)
  if isinstance(weights, str):
    _choice(c, "loss.head_weights", HEAD_WEIGHTS + ("or comma-separated numbers",))
  else:
    if len(weights) != m.n_future:
      _fail("loss.head_weights", f"a list needs one weight per head (model.n_future = "
            f"{m.n_future}), got {len(weights)}")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
      _fail("loss.head_weights", f"weights must be finite numbers >= 0, got {weights}")

  t, o = c.train, c.optim
  _choice(c, "optim.schedule", SCHEDULES)
  _choice(c, "optim.trainable", TRAINABLE)
  if o.trainable == "heads" and m.n_future < 2:
    _fail("optim.trainable", f"'heads' trains heads 2..n and model.n_future is {m.n_future}: "
          "set model.n_future >= 2 or optim.trainable='all'")
  for field in ("batch_size", "grad_accum", "steps", "log_every", "eval_every",
                "checkpoint_every", "keep_checkpoints", "eval_batches"):
    if int(getattr(t, field)) < 1:
      _fail(f"train.{field}", f"must be >= 1, got {getattr(t, field)}")
  if t.stop_at < 0:
    _fail("train.stop_at", f"must be >= 0 (0 = run to train.steps), got {t.stop_at}")
  if t.batch_size % t.grad_accum:
    _fail("train.grad_accum", f"must divide train.batch_size ({t.batch_size}), got "
          f"{t.grad_accum}")
  if o.warmup_steps < 0:
    _fail("optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
  if o.max_consecutive_nonfinite < 1:
    _fail("optim.max_consecutive_nonfinite", f"must be >= 1, got {o.max_consecutive_nonfinite}")
  _choice(c, "mesh.distributed", DISTRIBUTED_MODES)
  for axis in ("data", "fsdp", "tensor"):
    v = getattr(c.mesh, axis)
    if v != -1 and v < 1:
      _fail(f"mesh.{axis}", f"must be -1 (fill) or >= 1, got {v}")
  return c
