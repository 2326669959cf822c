"""The base config (every field, defaulting to plain next-token prediction), the allowed values
and ranges declared beside the fields, and reading and writing a config. Imports no JAX and
nothing from mtp_jax but JAX-free declarations below it: `model_args` (`ModelArgs` declares the
`config.model` fields, their allowed values and ranges on the fields themselves),
`data.fields` (the data section) and `loss_fields` (the loss's string fields, parsed).

Files in `configs/` import `base_config()` and change what they need; an entry point calls
`mtp_jax.config.validation.resolve()` once, after command-line overrides, so a bad value is one
clear `ValueError` at start-up, never a shape error deep inside a jitted function; the library
below it (build_model, the steps, decoding) takes the resolved config and checks nothing again.
"""

from __future__ import annotations

import os

import ml_collections

from mtp_jax.data import fields as data_fields
from mtp_jax.data.fields import TOKENIZERS
from mtp_jax.model_args import ModelArgs

# Allowed values and float ranges beside their fields: ALLOWED and FLOAT_RANGES below collect
# them (and config.model's, from ModelArgs) for config.validation; tests/test_config.py fails for
# a float field without a range. Kinds in a registry (model.heads.kind, data.corpus) are checked
# against the registry.
SCHEDULES = ("cosine", "linear", "constant")  # optim.schedule
# loss.draft_objective: what heads 2..n are trained on (loss.py): the hard next tokens, or head
# 1's own distribution at the same target position (KL to it, or total variation).
DRAFT_OBJECTIVES = ("ce", "kl_to_head1", "tv")
TRAINABLE = ("all", "heads")  # optim.trainable: "heads" trains heads 2..n only (optimizer.py)
DISTRIBUTED_MODES = ("auto", "on", "off")  # mesh.distributed (distributed.py)


def _positive(x):
  return x > 0


def _at_least_0(x):
  return x >= 0


ALLOWED = {
    **ModelArgs.rules("allowed"),
    "data.tokenizer": TOKENIZERS,
    "loss.draft_objective": DRAFT_OBJECTIVES,
    "optim.schedule": SCHEDULES,
    "optim.trainable": TRAINABLE,
    "mesh.distributed": DISTRIBUTED_MODES,
}
# Every float field: (the range in words, the test); nan fails every test.
FLOAT_RANGES = {
    **ModelArgs.rules("range"),
    "loss.geometric_decay": ("in (0, 1]", lambda x: 0 < x <= 1),
    "loss.mtp_lambda": (">= 0", _at_least_0),
    "loss.z_loss": (">= 0", _at_least_0),
    "loss.head_curriculum": ("in [0, 1] (0: off)", lambda x: 0 <= x <= 1),
    "optim.lr": ("> 0", _positive),
    "optim.min_lr_ratio": ("in [0, 1]", lambda x: 0 <= x <= 1),
    "optim.b1": ("in [0, 1)", lambda x: 0 <= x < 1),
    "optim.b2": ("in [0, 1)", lambda x: 0 <= x < 1),
    "optim.eps": ("> 0", _positive),
    "optim.weight_decay": (">= 0", _at_least_0),
    "optim.grad_clip": (">= 0 (0: no clipping)", _at_least_0),
}


def base_config() -> ml_collections.ConfigDict:
  """Every field the code reads, with next-token-prediction defaults."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  # Every model field and its default is declared once, in model_args.ModelArgs.
  c.model = ml_collections.ConfigDict()
  for group, name, default in ModelArgs.config_fields():
    if group and group not in c.model:
      c.model[group] = ml_collections.ConfigDict()
    (c.model[group] if group else c.model)[name] = default

  c.loss = ml_collections.ConfigDict()
  c.loss.token_chunks = 1  # token tiles per head inside the loss scan; 1 = whole head at once
  # "uniform", "geometric", "deepseek", or one weight per head: "1,0.5,0.5,0.5" (a string, so
  # it overrides from the command line; a Python list or tuple works too).
  c.loss.head_weights = "uniform"
  c.loss.geometric_decay = 0.5  # head i gets decay**(i-1)
  c.loss.mtp_lambda = 0.3  # DeepSeek-V3: main loss + lambda/D * sum of depth losses
  c.loss.z_loss = 0.0
  # loss.mtp_lambda over training (head_weights = "deepseek"; loss.head_weights_at):
  # "constant", steps "0.3@0,0.1@0.8" (value@fraction of train.steps, from 0: DeepSeek-V3's 0.3,
  # then 0.1), or "linear:0.3,0.1" / "cosine:0.3,0.1" (the first value at step 0, the second at
  # the end).
  c.loss.mtp_lambda_schedule = "constant"
  # Forward curriculum: > 0 switches heads on one by one, head k at fraction
  # head_curriculum * (k - 1) / (n_future - 1) of train.steps (all on from head_curriculum).
  c.loss.head_curriculum = 0.0
  # Heads 2..n: "ce" (the hard next tokens), "kl_to_head1" (KL from head 1's distribution at the
  # same target position, stop-gradient), "tv" (total variation to it).
  c.loss.draft_objective = "ce"

  c.data = data_fields.data_defaults()  # declared by the data package (data/fields.py)

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
  # Row slices of each (micro-)batch whose gradients run side by side and are summed (exact up
  # to summation order); on a CPU with as many slices as cores each runs single-threaded
  # matmuls. 0 = auto: 2 on one CPU device with 2 cores, else 1 (steps.batch_slices).
  c.train.batch_slices = 0
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
  # jax.distributed.initialize(): "auto" on TPU pods, srun -n 2+ (Slurm), Open MPI, or
  # when a coordinator address is given; "on" always; "off" never (distributed.py).
  c.mesh.distributed = "auto"
  # HOST:PORT of process 0, the process count and this process's id; empty / 0 / -1 read
  # JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, else JAX finds them (Slurm, MPI,
  # Cloud TPU). A launcher sets them per process: --config.mesh.process_id=$RANK.
  c.mesh.coordinator_address = ""
  c.mesh.num_processes = 0
  c.mesh.process_id = -1
  # Seconds to wait for every process at start-up, for a peer's heartbeat during the run, and
  # at every barrier (data built, checkpoint commits): past it, one line naming what was
  # missing, exit status 5 at start-up and 6 later (distributed.py).
  c.mesh.distributed_timeout_s = 300
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
  import importlib.util
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
  import json
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
