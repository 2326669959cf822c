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
import sys
from typing import Any, Callable, NoReturn, Sequence

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


def parse_flags(argv):
  """absl flag parsing, with a bad flag or config override as one line instead of a traceback."""
  try:
    rest = FLAGS(argv)
    if "config" in FLAGS and FLAGS["config"].present:
      _ = FLAGS.config.model  # the config file loads lazily: fail here, not deep in the run
    return rest
  except (AttributeError, KeyError) as e:
    bad = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")
           and str(e).strip("\"' ") in a.split("=")[0].split(".")]
    where = bad[0] if bad else "--config"
    print(f"error: {where}: no such config field ({str(e).strip(chr(34))})", file=sys.stderr)
  except (flags.Error, TypeError, ValueError, OSError) as e:
    msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if "Failed loading config file" in str(e):
      msg = "--config: cannot load " + " ".join(
          line.strip() for line in str(e).splitlines()[2:] if line.strip())
    print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)
