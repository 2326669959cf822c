"""What the absl entry points (`python -m mtp_jax.train`, `python -m mtp_jax.generate`) share:
flag parsing that turns a bad flag or config override into one line on stderr (exit 2), and a
quiet console.

    app.run(main, flags_parser=cli.parse_flags)
"""

from __future__ import annotations

import sys

from absl import flags, logging

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
