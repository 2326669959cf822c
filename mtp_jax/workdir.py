"""The run folder ("workdir") that training writes and the decoders, evaluators, sweeps and
converters read:

    DIR/config.json      the resolved config (CONFIG; `read_config`, `write_config`)
    DIR/checkpoints/     orbax steps (CHECKPOINTS): a run's train state and data-iterator
                         state, or an import's params alone (mtp_jax.convert)
    DIR/summary.json     a run's final figures, params_sha256 among them (SUMMARY)
    DIR/batches.log      one hash per step of the (global) batch it trained on (BATCHES)
    DIR/batches.process-<p>-of-<P>.log
                         a multi-process run's: per step, the hash of the rows process p
                         handed its devices, and which rows (`process_batches_path`)
    DIR/metrics.jsonl    every logged step (METRICS; metrics.MetricsWriter)
    DIR/tokenizer.model  an import's SentencePiece model, copied in (SPM_MODEL)

`load_workdir` (decoding and evaluation) and `init_state_from` (train.init_from) restore the
params through one function, `restore_params`. Only those functions load JAX (imported where
they run), so a sweep or a flag check reads a run folder without it.
"""

from __future__ import annotations

import dataclasses
import json
import os

import ml_collections

from mtp_jax import config as config_lib

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
SUMMARY = "summary.json"
BATCHES = "batches.log"
METRICS = "metrics.jsonl"
SPM_MODEL = "tokenizer.model"


def config_path(workdir: str) -> str:
  return os.path.join(workdir, CONFIG)


def checkpoints_dir(workdir: str) -> str:
  """Where a run in `workdir` keeps its checkpoints."""
  return os.path.join(workdir, CHECKPOINTS)


def summary_path(workdir: str) -> str:
  return os.path.join(workdir, SUMMARY)


def batches_path(workdir: str) -> str:
  return os.path.join(workdir, BATCHES)


def process_batches_path(workdir: str, process: int, count: int) -> str:
  return os.path.join(workdir, f"batches.process-{process}-of-{count}.log")


def read_config(workdir: str) -> ml_collections.ConfigDict:
  """workdir's config.json on today's defaults (config.load_json: an older workdir loads)."""
  return config_lib.load_json(config_path(workdir))


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  config_lib.save_json(config, config_path(workdir))


def read_summary(workdir: str) -> dict | None:
  """summary.json, or None when it is missing or unreadable (no run, not finished, or still
  being written)."""
  try:
    with open(summary_path(workdir)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps saved in checkpoints/ (folders named by their step), sorted."""
  d = checkpoints_dir(workdir)
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def is_workdir(workdir: str) -> bool:
  """config.json and a checkpoints/ folder: what load_workdir and train.init_from read."""
  return os.path.isfile(config_path(workdir)) and os.path.isdir(checkpoints_dir(workdir))


# Model fields that change how the same parameters are computed, not what they are: a run may
# resume with other values (e.g. a faster remat policy or attention kernel).
RUNTIME_MODEL_FIELDS = frozenset({"remat_policy", "attention_impl", "dtype", "max_len",
                                  "heads.parallel_stack"})


def check_resume(config: ml_collections.ConfigDict, workdir: str) -> None:
  """A workdir with checkpoints resumes with the model it was trained with: a model field that
  differs (e.g. a default changed since, such as model.vocab_multiple) is one line naming it,
  before config.json is overwritten, so nothing already saved is lost."""
  if not (os.path.isfile(config_path(workdir)) and checkpoint_steps(workdir)):
    return
  saved = read_config(workdir).model.to_dict()
  wanted = config.model.to_dict()
  flat = lambda d, pre="": {k2: v2 for k, v in d.items() for k2, v2 in (
      flat(v, f"{pre}{k}.").items() if isinstance(v, dict) else [(f"{pre}{k}", v)])}
  saved, wanted = flat(saved), flat(wanted)
  for field in sorted(set(wanted) - RUNTIME_MODEL_FIELDS):
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # JSON has lists, configs tuples
    if field in saved and norm(saved[field]) != norm(wanted[field]):
      raise ValueError(
          f"config.model.{field}: {workdir} has checkpoints of a model with {saved[field]!r}, "
          f"got {wanted[field]!r}; pass --config.model.{field}={saved[field]} to resume it, or "
          "use a new --workdir")


def restore_params(workdir: str, model, tx, config: ml_collections.ConfigDict, mesh):
  """(params, step) of workdir's latest good checkpoint, or None without one: a params-only
  checkpoint (mtp_jax.convert's), or a run's train state restored with its optimizer tree `tx`
  and everything but the params dropped; placed as `model` and `config` shard them on `mesh`."""
  from mtp_jax import steps as steps_lib
  from mtp_jax.checkpoint import Checkpointer
  target = steps_lib.abstract_state(model, tx, config, mesh)
  with Checkpointer(checkpoints_dir(workdir), async_save=False) as ckpt:
    if ckpt.saved_keys() == {"params"}:  # imported by mtp_jax.convert: no optimizer state
      target = {"params": target.params}
    restored = ckpt.restore_latest(target)
  if restored is None:
    return None
  state, step = restored
  return (state["params"] if isinstance(state, dict) else state.params), step


@dataclasses.dataclass
class Loaded:
  config: ml_collections.ConfigDict
  model: object
  params: object
  tokenizer: object
  step: int


def load_workdir(workdir: str) -> Loaded:
  """Config, model, params (latest good checkpoint) and tokenizer of a training workdir, or of
  one written by `mtp_jax.convert` (its checkpoint holds the params alone)."""
  from mtp_jax import optimizer as optim_lib
  from mtp_jax import sharding as shard_lib
  from mtp_jax.config import validation
  from mtp_jax.data import tokenizers
  from mtp_jax.model import build_model
  if not os.path.isfile(config_path(workdir)):
    raise ValueError(f"--workdir: {workdir!r} has no {CONFIG}; train into it first with "
                     f"python -m mtp_jax.train --workdir {workdir}")
  config = validation.resolve(read_config(workdir))
  model = build_model(config)
  restored = restore_params(workdir, model, optim_lib.make_optimizer(config), config,
                            shard_lib.make_mesh(config))
  if restored is None:
    raise ValueError(f"--workdir: {workdir!r} has no checkpoint in {CHECKPOINTS}/")
  params, step = restored
  return Loaded(config, model, params, tokenizers.get_tokenizer(config.data), step)


def check_init_from(config: ml_collections.ConfigDict, workdir: str) -> None:
  """train.init_from names a workdir holding this config's params tree and tokenizer; else one
  line naming the first difference (raised before the run writes anything)."""
  import filecmp

  import flax.linen as nn
  import jax

  from mtp_jax import steps as steps_lib
  from mtp_jax.config import validation
  from mtp_jax.data import tokenizers
  from mtp_jax.model import build_model
  field, hint = "config.train.init_from", "take config.model and config.data.tokenizer from it"
  if not is_workdir(workdir):
    raise ValueError(f"{field}: {workdir!r} is not a workdir with {CONFIG} and {CHECKPOINTS}/ "
                     "(e.g. one written by python -m mtp_jax.convert from-hf)")
  source = validation.validate(read_config(workdir))

  def shapes(c):
    model = build_model(c)
    tokens = steps_lib._dummy_tokens(c)
    tree = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens)["params"])
    leaves = jax.tree_util.tree_flatten_with_path(nn.unbox(tree))[0]
    return {jax.tree_util.keystr(p, simple=True, separator="/"): s.shape for p, s in leaves}

  ours, theirs = shapes(config), shapes(source)
  for name in sorted(set(ours) | set(theirs)):
    if ours.get(name) != theirs.get(name):
      raise ValueError(f"{field}: {workdir!r} holds another model (param {name}: "
                       f"{theirs.get(name)} there, {ours.get(name)} here); {hint} (configs/"
                       "finetune.py does)")
  d, s = config.data, source.data
  mine, theirs = tokenizers.tokenizer_file(d), tokenizers.tokenizer_file(s)
  if d.tokenizer != s.tokenizer or (d.tokenizer != "byte" and not (
      os.path.isfile(mine) and filecmp.cmp(mine, theirs, shallow=False))):
    raise ValueError(f"{field}: {workdir!r} was made with the {s.tokenizer} tokenizer "
                     f"{theirs!r}, this config reads {d.tokenizer} {mine!r}; {hint}")


def init_state_from(model, tx, config: ml_collections.ConfigDict, mesh, workdir: str):
  """train.init_from: the params of `workdir`'s latest checkpoint (`restore_params`, with the
  source run's own optimizer tree), on this run's shardings, with a fresh optimizer state at
  step 0 (a steps.TrainState): a new run, not a resume."""
  import jax
  import jax.numpy as jnp

  from mtp_jax import optimizer as optim_lib
  from mtp_jax import steps as steps_lib
  restored = restore_params(workdir, model, optim_lib.make_optimizer(read_config(workdir)),
                            config, mesh)
  if restored is None:
    raise ValueError(f"config.train.init_from: {workdir!r} has no checkpoint in {CHECKPOINTS}/")
  params = restored[0]
  del restored
  shardings = steps_lib.state_shardings(model, tx, config, mesh)
  fresh = jax.jit(lambda p: steps_lib.TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                                 opt_state=tx.init(p)),
                  out_shardings=shardings, donate_argnums=0)
  return fresh(params)
