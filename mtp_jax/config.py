"""The base config (every field, defaulting to plain next-token prediction) and its validation.

Files in `configs/` import `base_config()` and change what they need; the train and generate
entry points call `validate()` once, after command-line overrides, so a bad value is one clear
`ValueError` at start-up, never a shape error deep inside a jitted function.
"""

from __future__ import annotations

import os

import ml_collections

HEAD_KINDS = ("parallel", "projection", "sequential")
SEQ_CONCAT = ("emb_first", "hidden_first")
SEQ_TRUNK_STATE = ("post_norm", "pre_norm")
SEQ_OUTPUT_NORM = ("per_module", "shared")
# Where public implementations of DeepSeek-V3 MTP disagree (see heads.py).
SEQ_PRESETS = {
    # The released DeepSeek-V3 weights, Megatron, vLLM, SGLang: eh_proj([enorm(emb); hnorm(h)]),
    # h taken after the main model's final norm, `shared_head.norm` per module.
    "deepseek_v3": ("emb_first", "post_norm", "per_module"),
    # The paper's eq. 21 ([h; emb]) as MiMo writes it.
    "paper": ("hidden_first", "post_norm", "per_module"),
    # MaxText: trunk state before the final norm, the main model's norm reused for every depth.
    "maxtext": ("emb_first", "pre_norm", "shared"),
}
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
HEAD_WEIGHTS = ("uniform", "geometric", "deepseek")
SCHEDULES = ("cosine", "linear", "constant")
TOKENIZERS = ("byte", "sentencepiece")
CORPORA = ("python_code", "text_folder", "induction", "polynomial", "tfds", "array_record")
TASK_CORPORA = ("induction", "polynomial")  # synthetic, mtp_jax/data/tasks.py
POLY_OPS = "+-*o"  # polynomial task: add, negate, multiply, compose
DTYPES = ("float32", "bfloat16")
DISTRIBUTED_MODES = ("auto", "on", "off")


def base_config() -> ml_collections.ConfigDict:
  """Every field the code reads, with next-token-prediction defaults."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 259  # byte tokenizer: 256 bytes + pad, bos, eos
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
  c.model.heads = ml_collections.ConfigDict()
  c.model.heads.kind = "parallel"
  # Parallel head blocks: "vmap" runs them side by side (fast on small models); "scan" runs one
  # at a time, so only one head's activations are alive (what large models need: plan_memory).
  c.model.heads.parallel_stack = "vmap"
  c.model.heads.seq_preset = "deepseek_v3"  # sets the three fields below unless "" (custom)
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

  def merge(dst, src):
    for key, value in src.items():
      if isinstance(value, dict) and key in dst and isinstance(dst[key], ml_collections.ConfigDict):
        merge(dst[key], value)
      else:
        dst[key] = value
  merge(c, saved)
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


def _choice(c, field: str, allowed):
  value = c
  for part in field.split("."):
    value = getattr(value, part)
  if value not in allowed:
    _fail(field, f"got {value!r}, allowed: {', '.join(map(repr, allowed))}")


def apply_presets(c: ml_collections.ConfigDict) -> None:
  """Expands `model.heads.seq_preset` into the three fields it names."""
  preset = c.model.heads.seq_preset
  if preset:
    if preset not in SEQ_PRESETS:
      _fail("model.heads.seq_preset", f"got {preset!r}, allowed: '' or "
            + ", ".join(map(repr, SEQ_PRESETS)))
    h, defaults = c.model.heads, base_config().model.heads
    for field, value in zip(("seq_concat", "seq_trunk_state", "seq_output_norm"),
                            SEQ_PRESETS[preset]):
      if h[field] not in (value, defaults[field]):
        _fail("model.heads.seq_preset", f"preset {preset!r} sets {field} = {value!r}, but "
              f"{field} = {h[field]!r} was asked for; set seq_preset='' to choose the fields "
              "one by one")
      h[field] = value


def poly_max_len(n_ops: int, degree: int) -> int:
  """Characters of the longest polynomial-task example with n_ops operations: all binary, 2
  characters each ("* "), degree + 1 per operand, "=" and the answer."""
  return 2 * n_ops + (n_ops + 1) * (degree + 1) + degree


def _validate_task(d: ml_collections.ConfigDict, m: ml_collections.ConfigDict) -> None:
  """The `data.*` fields of the synthetic tasks (checked when data.corpus names one)."""
  if d.tokenizer != "byte":
    _fail("data.tokenizer", f"the {d.corpus} task counts one token per character: it needs "
          f"'byte', got {d.tokenizer!r}")
  if d.task_seed < 0:
    _fail("data.task_seed", f"must be >= 0, got {d.task_seed}")
  for field in ("task_train_size", "task_eval_size"):
    if d[field] < 1:
      _fail(f"data.{field}", f"must be >= 1, got {d[field]}")
  if d.corpus == "induction":
    if not 1 <= d.induction_pairs <= 26:
      _fail("data.induction_pairs", f"must be in [1, 26] (one uppercase letter each), got "
            f"{d.induction_pairs}")
    if d.induction_repeats < 2:
      _fail("data.induction_repeats", f"must be >= 2 (a name must recur to be copied), got "
            f"{d.induction_repeats}")
    need = 2 * d.induction_pairs * d.induction_repeats
    if d.induction_len < need:
      _fail("data.induction_len", f"must be >= 2 * induction_pairs * induction_repeats "
            f"({need}), got {d.induction_len}")
    if d.induction_len >= d.seq_len:
      _fail("data.induction_len", f"must be < data.seq_len ({d.seq_len}) so an example and its "
            f"eos fit in a row, got {d.induction_len}")
    return
  if d.poly_modulus not in (2, 3, 5, 7):
    _fail("data.poly_modulus", f"must be a prime of one digit (2, 3, 5, 7), got {d.poly_modulus}")
  if d.poly_degree < 1:
    _fail("data.poly_degree", f"must be >= 1, got {d.poly_degree}")
  ops = str(d.poly_ops)
  if not ops or any(op not in POLY_OPS for op in ops) or len(set(ops)) != len(ops):
    _fail("data.poly_ops", f"must be distinct characters of {POLY_OPS!r}, got {ops!r}")
  if d.poly_train_ops < 1:
    _fail("data.poly_train_ops", f"must be >= 1, got {d.poly_train_ops}")
  if d.poly_ood_ops <= d.poly_train_ops:
    _fail("data.poly_ood_ops", f"must be > data.poly_train_ops ({d.poly_train_ops}), got "
          f"{d.poly_ood_ops}")
  longest = lambda n: poly_max_len(n, d.poly_degree)
  if longest(d.poly_train_ops) >= d.seq_len:
    _fail("data.seq_len", f"must be > {longest(d.poly_train_ops)} (the longest polynomial "
          f"example with {d.poly_train_ops} operations, and its eos), got {d.seq_len}")
  if longest(d.poly_ood_ops) > m.max_len:
    _fail("model.max_len", f"must be >= {longest(d.poly_ood_ops)} (the longest test_ood "
          f"example, {d.poly_ood_ops} operations), got {m.max_len}")


def _validate_corpus(d: ml_collections.ConfigDict) -> None:
  """The `data.*` fields of the real corpora (data/corpora.py); the datasets themselves are
  checked when the pipeline opens them, still before anything is written."""
  if d.corpus == "tfds":
    if not d.tfds_name:
      _fail("data.tfds_name", "must name a prepared tfds dataset ('name/config:version') when "
            "data.corpus is 'tfds'")
    for field in ("train_split", "val_split"):
      if not d[field]:
        _fail(f"data.{field}", "must be a tfds split string such as 'train' or 'train[:99%]'")
  if d.corpus == "array_record":
    if not d.files:
      _fail("data.files", "must be a glob of shards written by `python -m mtp_jax.data.prepare` "
            "when data.corpus is 'array_record'")
    if not d.val_files and not 1 <= d.val_percent <= 50:
      _fail("data.val_percent", "must be in [1, 50] (every round(100 / val_percent)-th record "
            f"is held out for validation) when data.val_files is empty, got {d.val_percent}")


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks every field the code relies on; raises ValueError naming the field. Returns c."""
  m = c.model
  apply_presets(c)
  _choice(c, "model.heads.kind", HEAD_KINDS)
  _choice(c, "model.heads.parallel_stack", ("vmap", "scan"))
  _choice(c, "model.heads.seq_concat", SEQ_CONCAT)
  _choice(c, "model.heads.seq_trunk_state", SEQ_TRUNK_STATE)
  _choice(c, "model.heads.seq_output_norm", SEQ_OUTPUT_NORM)
  _choice(c, "model.remat_policy", REMAT_POLICIES)
  _choice(c, "model.dtype", DTYPES)
  _choice(c, "model.attention_impl", ("auto", "einsum", "cpu", "xla", "cudnn", "splash"))
  for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_len"):
    if int(getattr(m, field)) < 1:
      _fail(f"model.{field}", f"must be >= 1, got {getattr(m, field)}")
  if m.n_future < 1:
    _fail("model.n_future", f"must be >= 1, got {m.n_future}")
  if m.heads.kind == "parallel" and m.n_future > m.n_layers:
    _fail("model.n_future", f"parallel heads take their blocks from the trunk, so n_future "
          f"must be <= model.n_layers ({m.n_layers}), got {m.n_future}")
  if m.d_model % m.n_heads:
    _fail("model.n_heads", f"must divide model.d_model ({m.d_model}), got {m.n_heads}")
  if (m.d_model // m.n_heads) % 2:
    _fail("model.n_heads", f"head size d_model/n_heads = {m.d_model // m.n_heads} must be even "
          "for RoPE")
  if m.n_heads % m.n_kv_heads:
    _fail("model.n_kv_heads", f"must divide model.n_heads ({m.n_heads}), got {m.n_kv_heads}")

  d = c.data
  _choice(c, "data.corpus", CORPORA)
  _choice(c, "data.tokenizer", TOKENIZERS)
  if d.corpus in TASK_CORPORA:
    _validate_task(d, m)
  _validate_corpus(d)
  if d.seq_len <= m.n_future:
    _fail("data.seq_len", f"must be > model.n_future ({m.n_future}) so every head has a "
          f"target, got {d.seq_len}")
  if d.seq_len > m.max_len:
    _fail("data.seq_len", f"must be <= model.max_len ({m.max_len}), got {d.seq_len}")
  if d.tokenizer == "sentencepiece" and not d.spm_path:
    _fail("data.spm_path", "must name a SentencePiece model file when data.tokenizer is "
          "'sentencepiece'")
  if d.corpus == "text_folder" and not d.folder:
    _fail("data.folder", "must name a folder when data.corpus is 'text_folder'")
  if not 0 <= d.val_percent < 100:
    _fail("data.val_percent", f"must be in [0, 100), got {d.val_percent}")

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
    if any(w < 0 for w in weights):
      _fail("loss.head_weights", "weights must be >= 0")
  if not 0 < lo.geometric_decay <= 1:
    _fail("loss.geometric_decay", f"must be in (0, 1], got {lo.geometric_decay}")
  if lo.z_loss < 0:
    _fail("loss.z_loss", f"must be >= 0, got {lo.z_loss}")

  t, o = c.train, c.optim
  _choice(c, "optim.schedule", SCHEDULES)
  for field in ("batch_size", "grad_accum", "steps", "log_every", "eval_every",
                "checkpoint_every", "keep_checkpoints", "eval_batches"):
    if int(getattr(t, field)) < 1:
      _fail(f"train.{field}", f"must be >= 1, got {getattr(t, field)}")
  if t.stop_at < 0:
    _fail("train.stop_at", f"must be >= 0 (0 = run to train.steps), got {t.stop_at}")
  if t.batch_size % t.grad_accum:
    _fail("train.grad_accum", f"must divide train.batch_size ({t.batch_size}), got "
          f"{t.grad_accum}")
  if o.lr <= 0:
    _fail("optim.lr", f"must be > 0, got {o.lr}")
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
