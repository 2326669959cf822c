"""The small-scale tasks of Gloeckle et al. 2024 §4 as tfds builders, generated from a seed.

  induction    §4.1: lowercase filler with a few two-letter names ("Xy": an uppercase first
               letter, then a random lowercase one) planted `induction_repeats` times each. The
               second letter is unpredictable at a name's first occurrence and a pure copy at
               every later one: accuracy is scored only there (`induction_targets`).
  polynomial   §4.2: expressions over the ring F_p[X]/(X^d) (the paper: p = 7, d = 5) in prefix
               notation, "* + 31406 22011 - 00012=00021" (a polynomial is its d coefficients,
               constant first), answer after "=". Train and validation draw 1..poly_train_ops
               operations, test_ood poly_train_ops+1..poly_ood_ops (out of distribution).

Examples are ASCII, one byte-tokenizer token per character (`data.tokenizer` must be "byte"), so
a character index is a token position. Records are {"text", "path"} like the file corpora, so
the pipeline trains on them unchanged; the evaluator (mtp_jax/evaluation/tasks_eval.py) reads single
examples. Each split has its own seed ([data.task_seed, split, task]); validation is an
independent draw from the train distribution (so it may share short expressions with train).
Builds go to `data.dir/<task>/<name>/1.0.0/`, the name a hash of every field that decides the
content (listed in the description, which `prepare` compares: a change rebuilds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import string

import numpy as np
import tensorflow_datasets as tfds

from mtp_jax.data.local_builder import LocalBuilder

TASKS = ("induction", "polynomial")
SPLITS = {"induction": ("train", "validation"),
          "polynomial": ("train", "validation", "test_ood")}
# Bumped when a generator changes what a seed gives: the description changes, `prepare` rebuilds.
POLY_OPS = "+-*o"  # add, negate (unary), multiply, compose: p o q = p(q(X)); corpus.py checks
GENERATOR_VERSION = 2
_COMMON = ("task_seed", "task_train_size", "task_eval_size")
_KNOBS = {"induction": ("induction_len", "induction_pairs", "induction_repeats"),
          "polynomial": ("poly_modulus", "poly_degree", "poly_ops", "poly_train_ops",
                         "poly_ood_ops")}
_LOWER = np.array(list(string.ascii_lowercase))
_UPPER = np.array(list(string.ascii_uppercase))


def _rng(task: str, seed: int, split: str) -> np.random.Generator:
  return np.random.default_rng([seed, ("train", "validation", "test_ood").index(split),
                                TASKS.index(task)])


# Induction (§4.1).


def induction_example(rng: np.random.Generator, length: int, n_pairs: int,
                      repeats: int) -> str:
  """`length` letters: lowercase filler with `n_pairs` names, each planted `repeats` times."""
  chars_L = _LOWER[rng.integers(0, 26, length)]
  k = n_pairs * repeats
  # k sorted draws from length - k, shifted by 0..k-1: non-overlapping 2-letter slots.
  starts_K = np.sort(rng.choice(length - k, k, replace=False)) + np.arange(k)
  firsts_P = rng.choice(26, n_pairs, replace=False)
  seconds_P = rng.integers(0, 26, n_pairs)
  which_K = rng.permutation(np.repeat(np.arange(n_pairs), repeats))
  chars_L[starts_K] = _UPPER[firsts_P[which_K]]
  chars_L[starts_K + 1] = _LOWER[seconds_P[which_K]]
  return "".join(chars_L)


def induction_targets(text: str) -> tuple[np.ndarray, np.ndarray]:
  """(repeat_T, first_T): the positions t whose next-token prediction is scored.

  repeat_T[t]: text[t] is a name's first letter seen before, so text[t + 1] is a copy (the
  induction positions); first_T[t]: its first occurrence, where chance (1/26) is the best.
  """
  repeat_T = np.zeros(len(text), bool)
  first_T = np.zeros(len(text), bool)
  seen = set()
  for t, ch in enumerate(text[:-1]):
    if ch.isupper():
      (repeat_T if ch in seen else first_T)[t] = True
      seen.add(ch)
  return repeat_T, first_T


# Polynomials (§4.2). A polynomial is a tuple of d coefficients in [0, p), constant first; an
# expression is a polynomial or (op, operand) / (op, left, right) with op in POLY_OPS. Every
# result is reduced; composition acts on these representatives (it is not defined on the ring
# itself: X^5 = 0 but (1 + X)^5 != 0).
Poly = tuple
Expr = tuple  # a Poly, (op, operand) or (op, left, right)


def poly_mul(a: Poly, b: Poly, p: int) -> Poly:
  d = len(a)
  out = [0] * d
  for i, x in enumerate(a):
    for j in range(d - i):  # X^d = 0
      out[i + j] += x * b[j]
  return tuple(v % p for v in out)


def poly_compose(a: Poly, b: Poly, p: int) -> Poly:
  """a(b(X)) mod X^d, by Horner."""
  out = (0,) * len(a)
  for c in reversed(a):
    out = poly_mul(out, b, p)
    out = ((out[0] + c) % p,) + out[1:]
  return out


def evaluate_expr(expr: Expr, p: int) -> Poly:
  if not isinstance(expr[0], str):
    return expr
  op, *args = expr
  vals = [evaluate_expr(a, p) for a in args]
  if op == "-":
    return tuple(-x % p for x in vals[0])
  a, b = vals
  if op == "+":
    return tuple((x + y) % p for x, y in zip(a, b))
  if op == "*":
    return poly_mul(a, b, p)
  if op == "o":
    return poly_compose(a, b, p)
  raise ValueError(f"unknown operation {op!r}")


def random_expr(rng: np.random.Generator, n_ops: int, ops: str, p: int, d: int) -> Expr:
  """An expression with exactly n_ops operations; operations and coefficients uniform."""
  if n_ops == 0:
    return tuple(int(v) for v in rng.integers(0, p, d))
  op = ops[int(rng.integers(len(ops)))]
  if op == "-":
    return (op, random_expr(rng, n_ops - 1, ops, p, d))
  left = int(rng.integers(n_ops))  # operations in the left operand
  return (op, random_expr(rng, left, ops, p, d), random_expr(rng, n_ops - 1 - left, ops, p, d))


def format_expr(expr: Expr) -> str:
  """Prefix notation, space-separated: ('+', (1, 2), (3, 4)) -> "+ 12 34"."""
  if not isinstance(expr[0], str):
    return "".join(map(str, expr))
  return " ".join([expr[0]] + [format_expr(a) for a in expr[1:]])


def parse_expr(prompt: str) -> Expr:
  """The inverse of `format_expr` (a trailing "=" is ignored)."""
  tokens = prompt.rstrip("=").split()

  def read(i):
    tok = tokens[i]
    if tok == "-":
      arg, i = read(i + 1)
      return (tok, arg), i
    if tok in POLY_OPS:
      left, i = read(i + 1)
      right, i = read(i)
      return (tok, left, right), i
    return tuple(int(c) for c in tok), i + 1

  expr, end = read(0)
  if end != len(tokens):
    raise ValueError(f"trailing tokens in {prompt!r}")
  return expr


def count_ops(prompt: str) -> int:
  return sum(tok in POLY_OPS for tok in prompt.split())


def split_answer(text: str) -> tuple[str, str]:
  """(prompt up to and including "=", answer)."""
  i = text.index("=") + 1
  return text[:i], text[i:]


def poly_example(rng: np.random.Generator, n_ops: int, ops: str, p: int, d: int) -> str:
  expr = random_expr(rng, n_ops, ops, p, d)
  return f"{format_expr(expr)}={format_expr(evaluate_expr(expr, p))}"


# Splits and builders.


def task_params(data_config) -> dict:
  """The `data.*` fields that decide a task's content."""
  task = data_config.corpus
  return {f: data_config[f] for f in _COMMON + _KNOBS[task]}


def generate(task: str, params: dict, split: str) -> list[str]:
  """The texts of one split, deterministic in `params`."""
  if split not in SPLITS[task]:
    raise ValueError(f"split: got {split!r}, allowed: {', '.join(map(repr, SPLITS[task]))}")
  rng = _rng(task, params["task_seed"], split)
  n = params["task_train_size"] if split == "train" else params["task_eval_size"]
  if task == "induction":
    return [induction_example(rng, params["induction_len"], params["induction_pairs"],
                              params["induction_repeats"]) for _ in range(n)]
  lo, hi = 1, params["poly_train_ops"]
  if split == "test_ood":
    lo, hi = hi + 1, params["poly_ood_ops"]
  return [poly_example(rng, int(rng.integers(lo, hi + 1)), params["poly_ops"],
                       params["poly_modulus"], params["poly_degree"]) for _ in range(n)]


def generate_splits(task: str, params: dict) -> dict[str, list[str]]:
  return {split: generate(task, params, split) for split in SPLITS[task]}


@dataclasses.dataclass
class TaskConfig(tfds.core.BuilderConfig):
  params: dict = dataclasses.field(default_factory=dict)


class _TaskBuilder(LocalBuilder, skip_registration=True):
  """Writes a task's generated texts as {"text", "path"} records, in generation order."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "generated from data.task_seed"}
  TASK = ""

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, description=self.__doc__,
        features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                             "path": tfds.features.Text()}),
        disable_shuffling=True)

  def _split_generators(self, dl_manager):
    del dl_manager
    splits = generate_splits(self.TASK, self.builder_config.params)
    return {s: self._generate_examples(s, texts) for s, texts in splits.items()}

  def _generate_examples(self, split, texts):
    for i, text in enumerate(texts):
      yield i, {"text": text, "path": f"{split}/{i}"}


class Induction(_TaskBuilder, skip_registration=True):
  """Gloeckle et al. 2024 §4.1: copy a name's second letter when its first one recurs."""
  TASK = "induction"


class Polynomial(_TaskBuilder, skip_registration=True):
  """Gloeckle et al. 2024 §4.2: polynomial arithmetic in F_p[X]/(X^d), split by operations."""
  TASK = "polynomial"


def get_builder(data_config) -> _TaskBuilder:
  """The builder of the task `data.corpus` names; builds nothing."""
  task = data_config.corpus
  params = task_params(data_config)
  blob = json.dumps(params, sort_keys=True)
  key = hashlib.sha1(blob.encode()).hexdigest()[:10]
  name = (f"s{params['task_seed']}_n{params['task_train_size']}_e{params['task_eval_size']}"
          f"_{key}")
  config = TaskConfig(name=name, description=f"generator v{GENERATOR_VERSION} {blob}",
                      params=params)
  cls = Induction if task == "induction" else Polynomial
  return cls(config=config, data_dir=os.path.expanduser(data_config.dir),
             file_format="array_record")
