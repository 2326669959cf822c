"""Accuracy on the synthetic tasks of Gloeckle et al. 2024 §4, one unpacked example per row.

    python -m mtp_jax.evaluation.tasks_eval --workdir DIR [--limit N]     # prints JSON

Each example is scored alone: right-padded to the split's width, segment id 1 on its tokens and
0 on the padding, so no other example is in view (packed rows would let one leak in). A
`Predict` function maps (tokens_BxS, segment_ids_BxS) to next-token ids_BxS; for a trained model
it is head 1's argmax (`head1_predictor`), the next-token head, as the paper evaluates.

  induction   acc: accuracy at the induction positions (a recurring name's first letter; the
              target is the copied second letter); first_acc at first occurrences (chance 1/26).
  polynomial  exact: the whole answer right by greedy decoding; token_acc: answer digits right
              with the true digits before them (teacher-forced); exact per operation count.

One forward per example gives greedy exact match: greedy decoding reproduces the answer exactly
when, and only when, every argmax after the true prompt and the true answer prefix is right.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import json
import sys
from collections.abc import Callable

import numpy as np
from absl import flags

from mtp_jax import cli
from mtp_jax import distributed
from mtp_jax import workdir as workdir_lib
from mtp_jax.data import corpus
from mtp_jax.data import tasks
from mtp_jax.data import tokenizers

Predict = Callable[[np.ndarray, np.ndarray], np.ndarray]
_BYTE = tokenizers.ByteTokenizer()


def correct_next(predict: Predict, texts: list[str], *, batch_size: int = 64) -> list[np.ndarray]:
  """correct_T[t] = (prediction at t == token t + 1), t < len - 1, for each text.

  Rows are padded to one width (the longest text, rounded up to 16) and batches to batch_size,
  so `predict` sees one shape per call of this function.
  """
  ids = [_BYTE.encode(t) for t in texts]
  width = -(-max(len(x) for x in ids) // 16) * 16
  out = []
  for start in range(0, len(ids), batch_size):
    chunk = ids[start:start + batch_size]
    tokens_BxS = np.full((batch_size, width), _BYTE.pad_id, np.int32)
    segment_ids_BxS = np.zeros((batch_size, width), np.int32)
    for b, x in enumerate(chunk):
      tokens_BxS[b, :len(x)] = x
      segment_ids_BxS[b, :len(x)] = 1
    pred_BxS = np.asarray(predict(tokens_BxS, segment_ids_BxS))
    out.extend(pred_BxS[b, :len(x) - 1] == x[1:] for b, x in enumerate(chunk))
  return out


def score_induction(predict: Predict, texts: list[str], *, batch_size: int = 64) -> dict:
  correct = correct_next(predict, texts, batch_size=batch_size)
  hits = {"acc": 0, "first_acc": 0}
  counts = {"acc": 0, "first_acc": 0}
  for text, c_T in zip(texts, correct):
    for name, mask_T in zip(("acc", "first_acc"), tasks.induction_targets(text)):
      hits[name] += int(c_T[mask_T[:-1]].sum())
      counts[name] += int(mask_T.sum())
  out = {k: hits[k] / max(counts[k], 1) for k in hits}
  return dict(out, examples=len(texts), positions=counts["acc"])


def score_polynomial(predict: Predict, texts: list[str], *, batch_size: int = 64) -> dict:
  correct = correct_next(predict, texts, batch_size=batch_size)
  exact_by_ops: dict[int, list[bool]] = {}
  digits = []
  for text, c_T in zip(texts, correct):
    prompt, _ = tasks.split_answer(text)
    answer_c = c_T[len(prompt) - 1:]  # predictions of the answer's characters
    digits.append(answer_c)
    exact_by_ops.setdefault(tasks.count_ops(prompt), []).append(bool(answer_c.all()))
  exact = [e for v in exact_by_ops.values() for e in v]
  return {"exact": float(np.mean(exact)), "token_acc": float(np.concatenate(digits).mean()),
          "examples": len(texts),
          "exact_by_ops": {str(k): float(np.mean(v)) for k, v in sorted(exact_by_ops.items())}}


def score_split(predict: Predict, data_config, split: str, *, batch_size: int = 64,
                limit: int | None = None) -> dict:
  """The task metrics of one split of the task `data_config.corpus` names (built on first use)."""
  if data_config.corpus not in tasks.TASKS:
    raise ValueError(f"config.data.corpus: task evaluation needs one of "
                     f"{', '.join(map(repr, tasks.TASKS))}, got {data_config.corpus!r}")
  source = corpus.load_source(data_config, split)
  n = len(source) if limit is None else min(limit, len(source))
  texts = [corpus.record_text(source[i]) for i in range(n)]
  score = score_induction if data_config.corpus == "induction" else score_polynomial
  return score(predict, texts, batch_size=batch_size)


def head1_predictor(params, args) -> Predict:
  """Head 1's argmax at every position (the other heads are sliced off, not run)."""
  import jax
  import jax.numpy as jnp
  from mtp_jax.decoding import decode
  from mtp_jax.model import MTPModel, logits
  params_1, args_1 = decode.slice_heads(params, args, 1)
  model = MTPModel(args_1)

  @jax.jit
  def predict(p, tokens_BxS, segment_ids_BxS):
    h_1xBxSxD, _ = model.apply({"params": p}, tokens_BxS, segment_ids_BxS)
    return jnp.argmax(logits(p, args_1, h_1xBxSxD)[0], axis=-1)

  return lambda tokens_BxS, segment_ids_BxS: np.asarray(
      predict(params_1, tokens_BxS, segment_ids_BxS))


def score_workdir(workdir: str, *, splits=None, batch_size: int = 64,
                  limit: int | None = None) -> dict:
  """{"task", "step", <split>: metrics} for every evaluation split (all but train)."""
  loaded = workdir_lib.load_workdir(workdir)
  data = loaded.config.data
  if data.corpus not in tasks.TASKS:
    raise ValueError(f"--workdir: {workdir!r} trained on {data.corpus!r}, not a task "
                     f"({', '.join(tasks.TASKS)})")
  predict = head1_predictor(loaded.params, loaded.model.args)
  out = {"task": data.corpus, "step": loaded.step}
  for split in splits or tasks.SPLITS[data.corpus][1:]:
    out[split] = score_split(predict, data, split, batch_size=batch_size, limit=limit)
  return out


def _define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "a training workdir of a task config", flag_values=fv)
  flags.DEFINE_integer("limit", None, "examples per split (default: all)", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("batch_size", 64, "examples per forward", lower_bound=1, flag_values=fv)


def main(argv=None) -> int:
  """`argv` without the program name (default sys.argv[1:]); returns the exit status."""
  try:
    fv = cli.parse(argv, _define, prog="python -m mtp_jax.evaluation.tasks_eval",
                           usage="\n\n".join(__doc__.split("\n\n")[:2]), required=("workdir",))
    distributed.refuse_multiprocess("python -m mtp_jax.evaluation.tasks_eval")
    result = score_workdir(fv.workdir, batch_size=fv.batch_size, limit=fv.limit)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(result, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
