"""mtp_jax.cli (the flags of convert, tasks_eval and data.tokenizers: one-line errors,
exit status 2), config overrides parsed by the field's type, and conftest's `require`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags
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
    (["meta", "--ckpt", "/nonexistent"], 2, "stderr", "error: --out: required"),
    (["to-hf", "--out", "o", "--ckpt", "c"], 2, "stderr", "error: --ckpt: unknown flag"),
    (["nope"], 2, "stderr", "error: python -m mtp_jax.convert: unknown command 'nope'"),
])
def test_convert_command_line(argv, rc, stream, text):
  """The real entry point: bad input is one `error:` line and exit status 2 (--help:
  test_every_entry_point_has_help)."""
  p = subprocess.run([sys.executable, "-m", "mtp_jax.convert", *argv], capture_output=True,
                     text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
  assert p.returncode == rc, p.stdout + p.stderr
  assert text in getattr(p, stream), p.stdout + p.stderr
  if rc:
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("argv, text", [
    (["--ab", "model.fuse_projections=maybe"],
     "config.model.fuse_projections: got 'maybe', allowed: 'auto', 'on', 'off'"),
    (["--ab", "model.d_model"], "--ab: expected KEY=VALUE, got 'model.d_model'"),
    (["--peer", "--ref_tree", "/nonexistent"], "--ref_tree: needs --peer (not --in_process) and "
     "a checkout of this repository, got '/nonexistent'"),
])
def test_bench_train_bad_input(argv, text):
  """bench_train --ab (one change judged in one process) and --peer --ref_tree (against another
  checkout): bad input is one error line and exit status 2, before anything compiles."""
  p = subprocess.run([sys.executable, "experiments/bench_train.py", *argv],
                     capture_output=True, text=True, timeout=120, cwd=ROOT,
                     env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  assert p.returncode == 2, p.stdout + p.stderr
  assert text in p.stderr and "Traceback" not in p.stderr, p.stderr


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


# Every entry point a user runs, with --help (evaluate's own test is in test_evaluate.py). train
# and generate (absl's global FLAGS, both define --workdir) run as a user runs them; the others
# one after another in one process (runpy, as `python -m` / `python script.py` would): three
# processes in all, started at once.
_MODULES = ["mtp_jax.train", "mtp_jax.generate"]
_IN_ONE = ([("module", "mtp_jax.data.prepare", []), ("module", "mtp_jax.evaluation.tasks_eval", []),
            ("module", "mtp_jax.decoding.distill", [])]
           + [("module", "mtp_jax.convert", [sub]) for sub in (
               "", "meta", "deepseek", "from-hf", "to-hf", "to-meta", "to-deepseek")]
           + [("module", "mtp_jax.data.tokenizers", [sub]) for sub in ("", "train")]
           + [("script", f"experiments/{s}.py", []) for s in (
               "analyze_sweep", "bench_accel", "bench_cpu_defaults", "bench_cpu_dots", "bench_data",
               "bench_decode", "bench_decode_hf", "bench_finetune", "bench_memory", "bench_sandbox",
               "bench_train", "cycle_ab", "decode_acceptance", "demo_report", "distill_heads",
               "heads_objectives", "humaneval_hf", "plan_memory", "profile_decode", "small_tasks",
               "sweep")])
_RUN_IN_ONE = """
import json, runpy, sys
for kind, target, args in json.loads(sys.argv[1]):
  sys.argv = [target] + [a for a in args if a] + ["--help"]
  try:
    if kind == "module":
      runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
      runpy.run_path(target, run_name="__main__")
    rc = 0
  except SystemExit as e:
    rc = e.code or 0
  print(f"\\n@@ {rc}", flush=True)
"""


def _help_ok(out: str, rc: int) -> bool:
  return rc == 0 and "--" in out and ("usage" in out.lower() or "python -m" in out)


@pytest.mark.slow
def test_every_entry_point_has_help():
  """--help prints the usage and the flags on stdout and exits 0, compiling nothing."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  runs = {m: [sys.executable, "-m", m, "--help"] for m in _MODULES}
  runs["others"] = [sys.executable, "-c", _RUN_IN_ONE, json.dumps(_IN_ONE)]
  # MTP_JAX_REEXECED: the first tool's CPU defaults would re-exec the runner (runtime.py).
  procs = {name: subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=dict(env, MTP_JAX_REEXECED="1")
                                  if name == "others" else env)
           for name, cmd in runs.items()}
  failed = []
  for name, p in procs.items():
    out, err = p.communicate(timeout=600)
    if name != "others":
      if not _help_ok(out, p.returncode) or "Traceback" in err:
        failed.append(f"{name}: rc {p.returncode}\n{out[-1500:]}\n{err[-1500:]}")
      continue
    parts = out.split("\n@@ ")
    if p.returncode or len(parts) != len(_IN_ONE) + 1:
      failed.append(f"{len(parts) - 1} of {len(_IN_ONE)} ran\n{out[-1500:]}\n{err[-3000:]}")
    texts = [parts[0]] + [part.split("\n", 1)[-1] for part in parts[1:]]
    for i, (_, target, args) in enumerate(_IN_ONE[:len(parts) - 1]):
      rc = parts[i + 1].split("\n", 1)[0].strip()
      if not _help_ok(texts[i], int(rc) if rc.isdigit() else 1):
        failed.append(f"{target} {' '.join(args)} --help: rc {rc}\n{texts[i][-1500:]}")
  assert not failed, "\n\n".join(failed)


@pytest.mark.parametrize("argv, wanted", [
    (["--help"], "short"), (["-h"], "short"), (["--helpshort"], "short"), (["-?"], "short"),
    (["--config", "c.py", "--helpfull"], "full"), (["--workdir", "w"], None),
    (["--", "--help"], None)])
def test_help_wanted(argv, wanted):
  assert cli._help_wanted(argv) == wanted


# The flag errors of train / generate / data.prepare (absl's global FLAGS through
# cli.parse_flags): one `error: --name: ...` line, no Python repr (escaped quotes or newlines,
# a tuple or exception repr) and no traceback.
_REPR_SIGNS = ("\\n", "\\'", '\\"', "('", '("', "Error(", "Traceback", "[Errno")


def _assert_one_clean_line(p, needle):
  err = p.stderr.strip()
  assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
  assert len(err.splitlines()) == 1 and err.startswith("error: "), err[-2000:]
  assert not [s for s in _REPR_SIGNS if s in err], err
  assert needle in err, err


@pytest.fixture(scope="module")
def bad_config_files(tmp_path_factory):
  d = tmp_path_factory.mktemp("configs")
  (d / "syntax.py").write_text("def get_config(:\n")
  (d / "noget.py").write_text("x = 1\n")
  return d


_TRAIN_ERRORS = [  # a --config here replaces configs/tiny.py
    (["--config.train.stepz=3"], 'error: --config.train.stepz: no such config field; did you '
     'mean "steps"?'),
    (["--config.model.heads.kindd=x"], '--config.model.heads.kindd: no such config field; did '
     'you mean "kind"?'),
    (["--config.train.zzzzzzzzzz=1"], "--config.train.zzzzzzzzzz: no such config field"),
    (["--config.train.steps=abc"], "--config.train.steps: abc is not an integer"),
    (["--config.optim.lr=abc"], "--config.optim.lr: abc is not a number"),
    (["--config.train.steps"], "--config.train.steps: missing value"),
    (["--workdr=3"], "--workdr: unknown flag (flags: --config, --workdir"),
    (["--config=/nonexistent/c.py"], "--config: cannot load /nonexistent/c.py: no such file"),
    (["--config=DIR/syntax.py"], "syntax.py: invalid syntax at line 1"),
    (["--config=DIR/noget.py"], "noget.py defines no get_config()"),
]


@pytest.mark.parametrize("extra, needle", _TRAIN_ERRORS)
def test_config_flag_errors_are_clean_lines(bad_config_files, capsys, monkeypatch, extra,
                                           needle):
  """train's and generate's parser (cli.parse_flags) on flags as train defines them, in
  process: a fresh FlagValues each time, defined with the command line in sys.argv (where
  ml_collections finds the --config.* overrides to declare)."""
  extra = [a.replace("DIR", str(bad_config_files)) for a in extra]
  config = [] if extra[0].startswith("--config=") else [
      "--config", os.path.join(ROOT, "configs/tiny.py")]
  argv = ["train", *config, "--workdir", "w", *extra]
  monkeypatch.setattr(sys, "argv", argv)
  monkeypatch.delitem(sys.modules, "config_config", raising=False)  # ml_collections' module name
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config file", flag_values=fv,
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "workdir", flag_values=fv)
  with pytest.raises(SystemExit) as e:
    cli.parse_flags(argv, fv)
  err = capsys.readouterr().err
  _assert_one_clean_line(subprocess.CompletedProcess([], e.value.code, "", err), needle)


def test_train_config_typo_from_the_command_line(tmp_path):
  """The real entry point: a typo in a config override is one clean line, nothing written."""
  p = subprocess.run([sys.executable, "-m", "mtp_jax.train", "--config",
                      os.path.join(ROOT, "configs/tiny.py"), "--workdir", str(tmp_path / "w"),
                      "--config.train.stepz=3"], capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  _assert_one_clean_line(p, 'error: --config.train.stepz: no such config field; did you mean '
                         '"steps"?')
  assert not (tmp_path / "w").exists()


def test_prepare_flag_errors_are_clean_lines(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  for argv, needle in [([], "error: --source: required"),
                       (["--source", "folder:x", "--out", str(tmp_path), "--shards", "x"],
                        "error: --shards: x is not an integer")]:
    p = subprocess.run([sys.executable, "-m", "mtp_jax.data.prepare", *argv], env=env,
                       capture_output=True, text=True, timeout=120)
    _assert_one_clean_line(p, needle)


def test_flag_error_names_the_flag_of_a_library_parameter():
  """The decoding library names its parameters (k: ...); the CLIs name the flag (--heads: ...)."""
  from mtp_jax.decoding import decode as decode_lib
  with pytest.raises(ValueError) as e:
    decode_lib.repeat([[1]], 0)
  assert cli.flag_error(e.value) == "--num_samples: must be an integer >= 1, got 0"
  assert cli.flag_error(ValueError("k: between 1 and 4")) == "--heads: between 1 and 4"
  assert cli.flag_error(ValueError("--tree: x\nmore")) == "--tree: x"  # a flag's error, one line
  assert cli.flag_error(ValueError("prompt: empty")) == "prompt: empty"  # no flag of that name
