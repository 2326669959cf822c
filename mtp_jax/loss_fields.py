"""The loss section's string fields as a config spells them: the head-weight schemes
(loss.head_weights) and the lambda schedule (loss.mtp_lambda_schedule), parsed. JAX-free, below
the config (which declares and checks the fields) and the loss (which reads them)."""

from __future__ import annotations

import math

HEAD_WEIGHTS = ("uniform", "geometric", "deepseek")  # loss.head_weights, or one weight per head


def parse_lambda_schedule(value: str):
  """loss.mtp_lambda_schedule as (kind, args): ("constant", ()), ("steps", ((value, fraction),
  ...)), ("linear" | "cosine", (start, end)). ValueError (without the field's name) when it
  spells none of them."""
  text = str(value).replace(" ", "")
  if text == "constant":
    return "constant", ()
  kind = text.split(":", 1)[0] if text.startswith(("linear:", "cosine:")) else "steps"
  try:
    if kind == "steps":
      args = tuple((float(v), float(f)) for v, f in (p.split("@") for p in text.split(",")))
      values, fractions = [v for v, _ in args], [f for _, f in args]
    else:
      args = tuple(float(x) for x in text.split(":", 1)[1].split(","))
      values, fractions = args, [0.0]
      if len(args) != 2:
        raise ValueError
  except ValueError:
    raise ValueError(f"got {value!r}: 'constant', steps 'VALUE@FRACTION,...' from 0 (e.g. "
                     "'0.3@0,0.1@0.8'), 'linear:START,END' or 'cosine:START,END'") from None
  if not all(math.isfinite(v) and v >= 0 for v in values):
    raise ValueError(f"values must be finite numbers >= 0, got {value!r}")
  if fractions[0] != 0 or fractions[-1] >= 1 or any(
      b <= a for a, b in zip(fractions, fractions[1:])):
    raise ValueError(f"the fractions of train.steps must start at 0, rise, and stay below 1, "
                     f"got {value!r}")
  return kind, args


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
