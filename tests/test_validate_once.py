"""A config is checked once, at the entry point: `config.validation.validate` runs once for a
training run (command line to summary) and once for generate (the workdir's saved config);
`build_model` and everything below it take the resolved config and check nothing again."""

from __future__ import annotations

import types

import pytest
from conftest import REPO, copy_code_corpus

from mtp_jax import config as config_lib
from mtp_jax import generate, train
from mtp_jax.config import validation
from mtp_jax.model import build_model, model_args


@pytest.fixture
def validations(monkeypatch):
  """The calls of validation.validate (resolve calls it too), counted."""
  calls = []
  real = validation.validate

  def counted(c):
    calls.append(c)
    return real(c)
  monkeypatch.setattr(validation, "validate", counted)
  return calls


def _tiny(corpus):
  c = config_lib.load_file(f"{REPO}/configs/tiny.py")
  c.data.corpus, c.data.folder, c.data.dir = "text_folder", corpus["folder"], corpus["data_dir"]
  c.data.val_percent = 20
  c.train.steps = c.train.eval_every = c.train.checkpoint_every = 2
  c.train.log_every, c.train.eval_batches, c.train.async_checkpoints = 1, 1, False
  return c


@pytest.mark.slow  # a training run and generate (~9 s)
def test_train_then_generate_each_validate_once(tmp_path, validations, capsys):
  corpus = copy_code_corpus(tmp_path)
  workdir = str(tmp_path / "run")
  assert train.cli_main(types.SimpleNamespace(config=_tiny(corpus), workdir=workdir)) == 0
  assert len(validations) == 1, "a training run validated its config more than once"
  out = generate.run(workdir, ["def f(x):"], max_new_tokens=4, mode="greedy", heads=None)
  assert out and len(validations) == 2, "generate validated the saved config more than once"


def test_build_model_does_not_validate(validations):
  c = config_lib.base_config()
  c.model.n_future = 2
  resolved = validation.resolve(c)
  assert len(validations) == 1
  args = model_args(resolved)
  assert build_model(resolved).args == args == build_model(args).args
  assert len(validations) == 1


def test_model_args_names_an_unknown_kind():
  c = config_lib.base_config()
  c.model.heads.kind = "medusa"
  with pytest.raises(ValueError, match=r"^config\.model\.heads\.kind: got 'medusa', allowed: "):
    model_args(c)
