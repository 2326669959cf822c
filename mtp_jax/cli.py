"""Flags of every `python -m mtp_jax.*` entry point: absl, one style, one-line errors.

train and generate take ml_collections config flags (`--config.model.n_future=4`) on absl's
global FLAGS: `app.run(main, flags_parser=cli.parse_flags)` turns a bad flag or config override
into one line on stderr (exit 2), and `quiet_logs()` keeps the console for progress.

The other tools (convert, tasks_eval, data.tokenizers, data.prepare's helpers, evaluate) parse
with `parse` / `parse_command` below: absl too, so every entry point spells its flags one way
(`--flag=value` or `--flag value`, `--help`) and reports bad input one way: one line
`error: --flag: ...` on stderr and exit status 2. Each such parse fills a fresh
`flags.FlagValues`, not absl's global FLAGS: a tool's `main(argv)` can be called in-process (as
the tests do) any number of times with no value left over from an earlier call, and its flags
never clash with flags another imported module defines globally.

    def main(argv=None) -> int:
      fv = cli.parse(argv, _define, prog="python -m mtp_jax.tool", usage=__doc__,
                     required=("workdir",))
      ...
    if __name__ == "__main__":
      cli.run(main)
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from typing import Any, NoReturn
from collections.abc import Callable, Sequence

from absl import flags, logging

Define = Callable[[flags.FlagValues], None]


@dataclasses.dataclass(frozen=True)
class Command:
  """A subcommand: `prog NAME --flag ...`."""
  help: str
  define: Define
  required: tuple[str, ...] = ()


def _help_text(fv: flags.FlagValues, prog: str, usage: str, required: Sequence[str]) -> str:
  lines = [usage.strip(), "", f"flags of {prog}:"]
  for module, module_flags in sorted(fv.flags_by_module_dict().items()):
    if module == "absl.flags":  # --flagfile, --undefok
      continue
    for flag in sorted(module_flags, key=lambda f: f.name):
      text = f"  --{flag.name}: {flag.help}"
      if flag.name in required:
        text += " (required)"
      elif flag.default not in (None, "") and "default" not in flag.help:
        text += f" (default: {flag.default})"
      lines.append(text)
  return "\n".join(lines)


def _wants_help(argv: Sequence[str]) -> bool:
  args = list(argv)
  args = args[:args.index("--")] if "--" in args else args
  return any(a in ("-h", "--help", "-help") for a in args)


def parse(argv: Sequence[str] | None, define: Define, *, prog: str, usage: str,
          required: Sequence[str] = ()) -> flags.FlagValues:
  """`argv` (without the program name; None: sys.argv[1:]) parsed into flags that `define`
  declares on a fresh FlagValues. --help prints the flags and exits 0; a bad, unknown or missing
  flag, or a stray positional argument, raises ValueError naming it in one line."""
  argv = sys.argv[1:] if argv is None else list(argv)
  fv = flags.FlagValues()
  define(fv)
  if _wants_help(argv):
    print(_help_text(fv, prog, usage, required))
    raise SystemExit(0)
  try:
    rest = fv([prog] + argv)
  except flags.UnrecognizedFlagError as e:
    known = ", ".join(f"--{n}" for n in sorted(_own_flags(fv)))
    raise ValueError(f"--{e.flagname}: unknown flag for {prog} (its flags: {known})") from None
  except flags.Error as e:
    raise ValueError(str(e).splitlines()[0]) from None
  if rest[1:]:
    raise ValueError(f"{prog}: unexpected argument {rest[1]!r} (flags are --name=value)")
  for name in required:
    if fv[name].value in (None, ""):
      raise ValueError(f"--{name}: required ({fv[name].help})")
  return fv


def _own_flags(fv: flags.FlagValues) -> list[str]:
  return [f.name for m, fs in fv.flags_by_module_dict().items() if m != "absl.flags" for f in fs]


def parse_command(argv: Sequence[str] | None, commands: dict[str, Command], *, prog: str,
                  usage: str) -> tuple[str, flags.FlagValues]:
  """(command, flags) of `prog COMMAND --flag ...`: the command is the first argument. --help
  before a command lists the commands; after one, that command's flags."""
  argv = sys.argv[1:] if argv is None else list(argv)
  names = ", ".join(commands)
  if not argv or argv[0].startswith("-"):
    if argv and _wants_help(argv[:1]):
      print(usage.strip() + "\n\ncommands:\n" + "\n".join(
          f"  {name}: {c.help}" for name, c in commands.items())
          + f"\n\n{prog} COMMAND --help lists a command's flags.")
      raise SystemExit(0)
    raise ValueError(f"{prog}: the first argument is the command, one of {names}")
  name = argv[0]
  if name not in commands:
    raise ValueError(f"{prog}: unknown command {name!r}; commands: {names}")
  c = commands[name]
  return name, parse(argv[1:], c.define, prog=f"{prog} {name}", usage=c.help,
                     required=c.required)


# The decoding library's parameters (mtp_jax.decoding) and the flags that set them in generate,
# evaluate and distill: the library's errors name the parameter, the CLIs the flag.
DECODE_FLAGS = {"k": "heads", "tree": "tree", "max_new_tokens": "max_new_tokens",
                "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed",
                "num_samples": "num_samples"}


def flag_error(e: Exception, flag_of: dict[str, str] | None = None) -> str:
  """An error's first line, a library error `param: ...` written as the flag that sets the
  parameter (`--flag: ...`; flag_of: parameter -> flag, by default DECODE_FLAGS); any other
  line as it is."""
  msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
  param, sep, rest = msg.partition(": ")
  flag_of = DECODE_FLAGS if flag_of is None else flag_of
  return f"--{flag_of[param]}: {rest}" if sep and param in flag_of else msg


def run(main: Callable[[list[str]], int | None]) -> NoReturn:
  """sys.exit(main(sys.argv[1:])); a ValueError out of main is bad input: one line
  `error: ...` on stderr, exit status 2."""
  try:
    status = main(sys.argv[1:])
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    status = 2
  sys.exit(status or 0)


def parse_like(text: str, current: Any) -> Any:
  """A command-line value as the type of the config field it replaces: bools from
  true/false/1/0 (any case), ints, floats, tuples as Python literals ("(1, 2)"), strings as
  given; a field that is None takes a Python literal or else the string. Raises ValueError."""
  if isinstance(current, bool):
    value = {"true": True, "1": True, "false": False, "0": False}.get(text.strip().lower())
    if value is None:
      raise ValueError(f"expected true/false/1/0, got {text!r}")
    return value
  if isinstance(current, int):
    return int(text)
  if isinstance(current, float):
    return float(text)
  if isinstance(current, str):
    return text
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    if current is None:
      return text
    raise ValueError(f"expected a Python literal like {current!r}, got {text!r}") from None
  if isinstance(current, (tuple, list)):
    if not isinstance(value, (tuple, list)):
      raise ValueError(f"expected a tuple like {current!r}, got {text!r}")
    return type(current)(value)
  return value


def set_field(config, key: str, text: str) -> None:
  """config.<key> = parse_like(text, its current value), `key` dotted ("model.heads.kind"); a
  field that does not exist, or a value of the wrong type, raises ValueError naming the key."""
  *parents, field = key.split(".")
  node = config
  try:
    for part in parents:
      node = node[part]
    current = node[field]
  except (KeyError, AttributeError, TypeError):
    raise ValueError(f"{key}: no such config field") from None
  try:
    node[field] = parse_like(text, current)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{key}: {e}") from None


# train and generate: absl's global FLAGS with ml_collections config flags.
FLAGS = flags.FLAGS


def quiet_logs():
  """Orbax logs every save step at INFO; keep the console for progress unless -v is given."""
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def _help_wanted(argv: Sequence[str]) -> str | None:
  """"short" / "full" when argv asks for help (-h, --help, --helpshort, --helpfull), else None."""
  args = list(argv)
  args = args[:args.index("--")] if "--" in args else args
  if any(a in ("--helpfull", "-helpfull") for a in args):
    return "full"
  if any(a in ("-h", "--help", "-help", "-?", "--helpshort", "-helpshort") for a in args):
    return "short"
  return None


def _unquote(text: str) -> str:
  return text.strip().strip("'\"")


def config_field_error(e: BaseException, argv: Sequence[str]) -> str:
  """One line for a `--config.a.b=v` naming no config field, from ml_collections' KeyError /
  AttributeError (whose text is a repr like `'stepz'\\nDid you mean "steps" instead of
  "stepz"?`): `--config.train.stepz: no such config field; did you mean "steps"?`."""
  while e.args and isinstance(e.args[0], BaseException):  # AttributeError(KeyError(...))
    e = e.args[0]
  text = str(e.args[0]) if e.args else str(e)  # str(KeyError) would be a repr of it
  lines = [line for line in text.splitlines() if line.strip()]
  name = _unquote(lines[0]) if lines else ""
  overrides = [a.split("=")[0].lstrip("-") for a in argv if a.startswith("--config.")]
  bad = [o for o in overrides if name and name in o.split(".")]
  where = "--" + bad[0] if bad else "--config"
  msg = f"{where}: no such config field" + ("" if bad or not name else f" {name}")
  hint = [line for line in lines[1:] if line.startswith("Did you mean")]
  if hint and '"' in hint[0]:
    msg += f'; did you mean "{hint[0].split(chr(34))[1]}"?'
  return msg


def _flag_error(e: flags.Error, fv: flags.FlagValues) -> str:
  """One line for absl's flag errors, without reprs: `--name: what is wrong`."""
  text = (str(e).strip().splitlines() or [type(e).__name__])[0]
  if isinstance(e, flags.UnrecognizedFlagError) and e.flagname.startswith("config."):
    return f"--{e.flagname}: no such config field"
  if isinstance(e, flags.UnrecognizedFlagError):
    by_module = fv.flags_by_module_dict()
    own = by_module.get(sys.argv[0]) or [  # the flags the entry point defines
        f for m, fs in by_module.items() if not m.startswith("absl.") for f in fs]
    own = sorted({f.name for f in own if "." not in f.name})
    known = ", ".join(f"--{n}" for n in own) + (", --config.FIELD=VALUE" if "config" in own
                                                 else "")
    return f"--{e.flagname}: unknown flag" + (f" (flags: {known})" if known else "")
  if text.startswith("flag --") and ": " in text:  # "flag --x=v: invalid literal for int() ..."
    flag, reason = text[len("flag "):].split(": ", 1)
    name, _, value = flag.partition("=")
    if "must have a value other than None" in reason:
      return f"{name}: required"
    if reason.startswith("invalid literal for int()"):
      reason = f"{value} is not an integer"
    elif reason.startswith("could not convert string to float"):
      reason = f"{value} is not a number"
    return f"{name}: {reason.replace(chr(39), '')}"
  if text.startswith("Missing value for flag "):
    return f"{text[len('Missing value for flag '):]}: missing value (--name=value)"
  return text


def _config_path(argv: Sequence[str]) -> str:
  """The file given to --config (the last one, as absl takes it)."""
  path = "the config file"
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      path = a.split("=", 1)[1]
    elif a == "--config" and i + 1 < len(argv):
      path = argv[i + 1]
  return path


def parse_flags(argv, fv: flags.FlagValues | None = None):
  """absl flag parsing for train, generate and data.prepare (`fv`: absl's global FLAGS unless
  given): --help / -h / --helpfull print the module's usage and its flags and exit 0; a bad
  flag or config override is one line `error: --name: ...`, exit status 2."""
  from absl import app
  fv = FLAGS if fv is None else fv
  wanted = _help_wanted(argv[1:])
  if wanted:
    app.usage(shorthelp=wanted == "short", writeto_stdout=True, exitcode=0)
  try:
    rest = fv(argv)
    if "config" in fv and fv["config"].present:
      _ = fv.config.model  # the config file loads lazily: fail here, not deep in the run
    return rest
  except (AttributeError, KeyError) as e:
    if "get_config" in str(e):
      print(f"error: --config: {_config_path(argv)} defines no get_config()", file=sys.stderr)
    else:
      print(f"error: {config_field_error(e, argv[1:])}", file=sys.stderr)
  except flags.Error as e:
    print(f"error: {_flag_error(e, fv)}", file=sys.stderr)
  except SyntaxError as e:
    print(f"error: --config: cannot load {_config_path(argv)}: {e.msg} at line {e.lineno}",
          file=sys.stderr)
  except (TypeError, ValueError, OSError) as e:
    msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if "config" in msg.lower() and "load" in msg:  # ml_collections' "Failed loading config file"
      reason = str(e).strip().splitlines()[-1]
      reason = re.sub(r"\[Errno \d+\] ", "", reason.split("failure to load: ")[-1]).strip()
      reason = reason.split(": '")[0].split(': "')[0]  # "No such file or directory: '/x.py'"
      msg = f"--config: cannot load {_config_path(argv)}: {reason[:1].lower()}{reason[1:]}"
    print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)
