"""mtp_jax.cli (the flags of convert, tasks_eval and data.tokenizers: one-line errors,
exit status 2), config overrides parsed by the field's type, and conftest's `require`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from absl import flags
from conftest import require

from mtp_jax import cli
from mtp_jax import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _define(fv):
  flags.DEFINE_string("workdir", None, "a workdir", flag_values=fv)
  flags.DEFINE_integer("limit", 3, "examples", lower_bound=1, flag_values=fv)
  flags.DEFINE_enum("dtype", "float32", ("float32", "bfloat16"), "dtype", flag_values=fv)


def _parse(argv):
  return cli.parse(argv, _define, prog="tool", usage="tool --workdir DIR",
                           required=("workdir",))


def test_parse_values_and_fresh_flags_each_call():
  fv = _parse(["--workdir", "a", "--limit=5", "--dtype", "bfloat16"])
  assert (fv.workdir, fv.limit, fv.dtype) == ("a", 5, "bfloat16")
  fv = _parse(["--workdir=b"])  # nothing left over from the call before
  assert (fv.workdir, fv.limit, fv.dtype) == ("b", 3, "float32")


@pytest.mark.parametrize("argv, message", [
    ([], "--workdir: required"),
    (["--workdir", "a", "--limit", "x"], "--limit"),
    (["--workdir", "a", "--limit", "0"], "--limit"),
    (["--workdir", "a", "--dtype", "f16"], "float32|bfloat16"),
    (["--workdir", "a", "--bogus", "1"], "--bogus: unknown flag for tool (its flags: --dtype, "
     "--limit, --workdir)"),
    (["--workdir", "a", "stray"], "unexpected argument 'stray'"),
])
def test_parse_errors_are_one_line(argv, message):
  with pytest.raises(ValueError) as e:
    _parse(argv)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_parse_help_exits_zero(capsys):
  with pytest.raises(SystemExit) as e:
    _parse(["--workdir", "a", "--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert "tool --workdir DIR" in out and "--workdir: a workdir (required)" in out
  assert "--limit: examples (default: 3)" in out and "flagfile" not in out


def test_parse_command():
  commands = {"a": cli.Command("do a", _define, ("workdir",)),
              "b": cli.Command("do b", lambda fv: None)}
  name, fv = cli.parse_command(["a", "--workdir", "w"], commands, prog="t", usage="u")
  assert name == "a" and fv.workdir == "w"
  assert cli.parse_command(["b"], commands, prog="t", usage="u")[0] == "b"
  with pytest.raises(ValueError, match="unknown command 'c'; commands: a, b"):
    cli.parse_command(["c"], commands, prog="t", usage="u")
  with pytest.raises(ValueError, match="the first argument is the command, one of a, b"):
    cli.parse_command(["--workdir", "w"], commands, prog="t", usage="u")
  with pytest.raises(ValueError, match="--workdir: unknown flag for t b"):
    cli.parse_command(["b", "--workdir", "w"], commands, prog="t", usage="u")


@pytest.mark.parametrize("argv, rc, stream, text", [
    (["--help"], 0, "stdout", "commands:\n  meta:"),
    (["meta", "--help"], 0, "stdout", "--ckpt: checkpoint folder (required)"),
    (["meta", "--ckpt", "/nonexistent"], 2, "stderr", "error: --out: required"),
    (["to-hf", "--out", "o", "--ckpt", "c"], 2, "stderr", "error: --ckpt: unknown flag"),
    (["nope"], 2, "stderr", "error: python -m mtp_jax.convert: unknown command 'nope'"),
])
def test_convert_command_line(argv, rc, stream, text):
  """The real entry point: --help exits 0; bad input is one `error:` line and exit status 2."""
  p = subprocess.run([sys.executable, "-m", "mtp_jax.convert", *argv], capture_output=True,
                     text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
  assert p.returncode == rc, p.stdout + p.stderr
  assert text in getattr(p, stream), p.stdout + p.stderr
  if rc:
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_run_turns_value_error_into_exit_2(capsys, monkeypatch):
  def main(argv):
    raise ValueError(f"--x: bad {argv}")
  monkeypatch.setattr(sys, "argv", ["prog", "1"])
  with pytest.raises(SystemExit) as e:
    cli.run(main)
  assert e.value.code == 2 and capsys.readouterr().err == "error: --x: bad ['1']\n"
  with pytest.raises(SystemExit) as e:
    cli.run(lambda argv: None)
  assert e.value.code == 0


def test_parse_like_uses_the_field_type():
  assert cli.parse_like("False", True) is False  # bool("False") would be True
  assert cli.parse_like("0", True) is False and cli.parse_like("TRUE", False)
  with pytest.raises(ValueError, match="true/false/1/0"):
    cli.parse_like("yes", False)
  assert cli.parse_like("8", 4) == 8 and isinstance(cli.parse_like("8", 4), int)
  with pytest.raises(ValueError):
    cli.parse_like("8.5", 4)
  assert cli.parse_like("1e-3", 0.1) == 1e-3
  assert cli.parse_like("False", "abc") == "False"
  assert cli.parse_like("(1, 2)", (3,)) == (1, 2)
  assert cli.parse_like("7", None) == 7 and cli.parse_like("x", None) == "x"


def test_set_field_nested_and_errors():
  c = config_lib.base_config()
  cli.set_field(c, "model.tie_embeddings", "false")
  cli.set_field(c, "model.heads.kind", "sequential")
  cli.set_field(c, "train.batch_size", "3")
  assert (c.model.tie_embeddings, c.model.heads.kind, c.train.batch_size) == (
      False, "sequential", 3)
  with pytest.raises(ValueError, match="model.nope: no such config field"):
    cli.set_field(c, "model.nope", "1")
  with pytest.raises(ValueError, match="train.batch_size: "):
    cli.set_field(c, "train.batch_size", "many")


def test_require_skips_locally_and_fails_under_ci(monkeypatch):
  assert require("json").__name__ == "json"
  monkeypatch.delenv("CI", raising=False)
  with pytest.raises(pytest.skip.Exception):
    require("mtp_jax_no_such_module")
  monkeypatch.setenv("CI", "true")
  with pytest.raises(pytest.fail.Exception, match="CI is set and mtp_jax_no_such_module"):
    require("mtp_jax_no_such_module")
  monkeypatch.setenv("CI", "")  # empty: not CI
  with pytest.raises(pytest.skip.Exception):
    require("mtp_jax_no_such_module")
