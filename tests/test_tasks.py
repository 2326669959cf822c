"""Synthetic tasks (Gloeckle et al. 2024 §4): generators, builders, the evaluator. CPU, seconds.

Both tasks are built once, tiny, in a tmp data.dir; the evaluator is checked with fake predict
functions (an oracle, a causal copier, one with a wrong digit) and once with a real model.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtp_jax import config as config_lib
from mtp_jax.config import validation
from mtp_jax.evaluation import tasks_eval
from mtp_jax.data import corpus
from mtp_jax.data import pipeline
from mtp_jax.data import tasks
from mtp_jax.data import tokenizers

BYTE = tokenizers.ByteTokenizer()


def _config(task, data_dir, **data):
  c = config_lib.base_config()
  c.data.corpus, c.data.dir, c.data.seq_len = task, str(data_dir), 64
  c.data.task_train_size, c.data.task_eval_size = 300, 60
  c.data.induction_len, c.data.induction_pairs, c.data.induction_repeats = 31, 3, 2
  c.data.poly_train_ops, c.data.poly_ood_ops = 3, 5
  c.data.whole_docs = True
  c.train.batch_size = 4
  for field, value in data.items():
    setattr(c.data, field, value)
  return validation.validate(c)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("datasets")
  for task in tasks.TASKS:
    data = _config(task, d).data
    corpus.get(data).prepare(data)
  return d


def _texts(c, split):
  src = corpus.load_source(c.data, split)
  return [corpus.record_text(src[i]) for i in range(len(src))]


# Generators.


@pytest.mark.parametrize("task", tasks.TASKS)
def test_generation_is_deterministic_in_the_seed(task, tmp_path):
  params = tasks.task_params(_config(task, tmp_path).data)
  a = tasks.generate_splits(task, params)
  assert a == tasks.generate_splits(task, params)
  assert set(a) == set(tasks.SPLITS[task])
  b = tasks.generate_splits(task, dict(params, task_seed=1))
  for split in a:
    assert len(a[split]) == (300 if split == "train" else 60)
    assert len(set(a[split]) & set(b[split])) <= 2  # another seed: other examples
  assert len(set(a["train"]) & set(a["validation"])) <= 2


def test_induction_hand_checked_and_invariants(tmp_path):
  repeat_T, first_T = tasks.induction_targets("aXbcXbZdXbZd")
  assert np.flatnonzero(repeat_T).tolist() == [4, 8, 10]
  assert np.flatnonzero(first_T).tolist() == [1, 6]
  params = tasks.task_params(_config("induction", tmp_path).data)
  for text in tasks.generate("induction", params, "validation"):
    assert len(text) == 31 and text.isascii() and text.isalpha()
    repeat_T, first_T = tasks.induction_targets(text)
    uppers = [i for i, ch in enumerate(text) if ch.isupper()]
    assert len(uppers) == 3 * 2 and first_T.sum() == 3 and repeat_T.sum() == 3
    for t in np.flatnonzero(repeat_T):  # the target is a copy of the first occurrence's
      earlier = text.index(text[t])
      assert earlier < t and first_T[earlier] and text[t + 1] == text[earlier + 1]
      assert text[t + 1].islower()


def _reference_value(prompt: str, p: int, d: int) -> list[int]:
  """Evaluates prefix notation right to left with a stack, in Z[X] (numpy object arrays), and
  reduces mod (p, X^d) only at the end (reduction is a ring homomorphism), where
  tasks.evaluate_expr reduces after every operation. Composition is not defined on the quotient
  ring (X^5 = 0 but (1 + X)^5 != 0), so its outer operand is reduced first, as the task does."""
  P = np.polynomial.polynomial
  reduce = lambda v: np.array([int(c) % p for c in v[:d]], dtype=object)
  stack = []
  for tok in reversed(prompt.rstrip("=").split()):
    if tok == "-":
      stack.append(-stack.pop())
    elif tok in "+*o":
      a, b = stack.pop(), stack.pop()
      if tok == "+":
        stack.append(P.polyadd(a, b))
      elif tok == "*":
        stack.append(P.polymul(a, b))
      else:  # a(b(X)) = sum_i a_i b^i
        a, out = reduce(a), np.array([0], dtype=object)
        for i, c in enumerate(a):
          out = P.polyadd(out, c * P.polypow(b, i) if i else np.array([c], dtype=object))
        stack.append(out)
    else:
      stack.append(np.array([int(ch) for ch in tok], dtype=object))
  (value,) = stack
  value = list(value[:d]) + [0] * max(0, d - len(value))
  return [int(v) % p for v in value]


def test_polynomial_hand_checked_and_against_a_reference(tmp_path):
  p = 7
  assert tasks.evaluate_expr(("*", (1, 1, 0, 0, 0), (6, 1, 0, 0, 0)), p) == (6, 0, 1, 0, 0)
  assert tasks.evaluate_expr(("*", (0, 0, 0, 0, 1), (0, 1, 0, 0, 0)), p) == (0,) * 5  # X^5 = 0
  assert tasks.evaluate_expr(("-", (0, 3, 0, 0, 6)), p) == (0, 4, 0, 0, 1)
  assert tasks.evaluate_expr(("o", (1, 1, 0, 0, 0), (0, 0, 1, 0, 0)), p) == (1, 0, 1, 0, 0)
  assert tasks.evaluate_expr(("o", (0, 0, 1, 0, 0), (1, 1, 0, 0, 0)), p) == (1, 2, 1, 0, 0)
  expr = ("+", ("*", (1, 1, 0, 0, 0), (6, 1, 0, 0, 0)), ("-", (0, 0, 0, 0, 2)))
  assert tasks.format_expr(expr) == "+ * 11000 61000 - 00002"
  assert tasks.parse_expr("+ * 11000 61000 - 00002=") == expr
  assert _reference_value("+ * 11000 61000 - 00002", p, 5) == [6, 0, 1, 0, 5]
  params = tasks.task_params(_config("polynomial", tmp_path, poly_ops="+-*o").data)
  for split in ("train", "test_ood"):
    for text in tasks.generate("polynomial", params, split)[:40]:
      prompt, answer = tasks.split_answer(text)
      assert [int(ch) for ch in answer] == _reference_value(prompt, 7, 5), text
      assert tasks.format_expr(tasks.parse_expr(prompt)) + "=" == prompt


def test_ood_split_has_more_operations(data_dir):
  c = _config("polynomial", data_dir)
  ops = {s: [tasks.count_ops(tasks.split_answer(t)[0]) for t in _texts(c, s)]
         for s in tasks.SPLITS["polynomial"]}
  assert set(ops["train"]) == set(ops["validation"]) == {1, 2, 3}
  assert set(ops["test_ood"]) == {4, 5}
  assert corpus.poly_max_len(2, 5) == len("+ + 12345 12345 12345=12345")
  for split, texts in (("train", _texts(c, "train")), ("test_ood", _texts(c, "test_ood"))):
    assert max(len(t) for t in texts) <= corpus.poly_max_len(3 if split == "train" else 5, 5)


# Builders and the pipeline.


@pytest.mark.parametrize("task", tasks.TASKS)
def test_builds_through_the_pipeline_whole_examples(task, data_dir):
  c = _config(task, data_dir)
  assert _texts(c, "train") == tasks.generate_splits(task, tasks.task_params(c.data))["train"]
  it = pipeline.make_iterator(c, "train")
  generated = set(_texts(c, "train"))
  for _ in range(5):
    batch = next(it)
    assert batch["tokens"].shape == (4, 64)
    for tokens_S, seg_S in zip(batch["tokens"], batch["segment_ids"]):
      for s in range(1, seg_S.max() + 1):  # every segment is one whole example and its eos
        doc_T = tokens_S[seg_S == s]
        assert doc_T[-1] == BYTE.eos_id and BYTE.decode(doc_T) in generated
  for split in tasks.SPLITS[task][1:]:
    batches = list(pipeline.make_iterator(c, split))
    assert sum(int((b["tokens"] == BYTE.eos_id).sum()) for b in batches) == 60
  with pytest.raises(ValueError, match="split: got 'test'"):
    corpus.load_source(c.data, "test")


# Config validation.


BAD = [
    ("induction", "tokenizer", "sentencepiece", "data.tokenizer"),
    ("induction", "task_train_size", 0, "data.task_train_size"),
    ("induction", "task_seed", -1, "data.task_seed"),
    ("induction", "induction_repeats", 1, "data.induction_repeats"),
    ("induction", "induction_pairs", 27, "data.induction_pairs"),
    ("induction", "induction_len", 11, "data.induction_len"),
    ("induction", "induction_len", 64, "data.induction_len"),
    ("polynomial", "poly_modulus", 6, "data.poly_modulus"),
    ("polynomial", "poly_ops", "+/", "data.poly_ops"),
    ("polynomial", "poly_ops", "", "data.poly_ops"),
    ("polynomial", "poly_ood_ops", 3, "data.poly_ood_ops"),
    ("polynomial", "seq_len", 32, "data.seq_len"),
    ("polynomial", "poly_degree", 0, "data.poly_degree"),
]


@pytest.mark.parametrize("task,field,value,named", BAD,
                         ids=[f"{b[1]}={b[2]!r}" for b in BAD])
def test_bad_task_config_is_one_line_naming_the_field(task, field, value, named, tmp_path):
  c = _config(task, tmp_path)
  setattr(c.data, field, value)
  with pytest.raises(ValueError, match=rf"^config\.{named}: [^\n]*$"):
    validation.validate(c)


def test_ood_longer_than_max_len_is_refused(tmp_path):
  c = _config("polynomial", tmp_path)
  c.model.max_len = 64
  c.data.poly_ood_ops = 9
  with pytest.raises(ValueError, match=r"^config\.model\.max_len: .*test_ood"):
    validation.validate(c)


# The evaluator.


def _oracle(tokens_BxS, segment_ids_BxS):
  """Cheats: reads the next token."""
  return np.pad(tokens_BxS[:, 1:], ((0, 0), (0, 1)))


def _copier(tokens_BxS, segment_ids_BxS):
  """A causal induction rule: after a letter seen before, what followed it; else 'a'."""
  pred_BxS = np.full_like(tokens_BxS, ord("a"))
  for b, row in enumerate(tokens_BxS):
    assert (segment_ids_BxS[b] <= 1).all()  # one example per row, never packed
    last = {}
    for t, tok in enumerate(row[:-1]):
      if tok in last:
        pred_BxS[b, t] = row[last[tok] + 1]
      last.setdefault(tok, t)
  return pred_BxS


def test_evaluator_induction(data_dir):
  c = _config("induction", data_dir)
  for batch_size in (7, 64):
    assert tasks_eval.score_split(_oracle, c.data, "validation", batch_size=batch_size) == {
        "acc": 1.0, "first_acc": 1.0, "examples": 60, "positions": 180}
  copied = tasks_eval.score_split(_copier, c.data, "validation")
  assert copied["acc"] == 1.0 and copied["first_acc"] < 0.3
  second = [t[i + 1] for t in _texts(c, "validation")
            for i in np.flatnonzero(tasks.induction_targets(t)[1])]
  assert copied["first_acc"] == pytest.approx(np.mean([ch == "a" for ch in second]))


def test_evaluator_polynomial(data_dir):
  c = _config("polynomial", data_dir)
  result = tasks_eval.score_split(_oracle, c.data, "test_ood", batch_size=16)
  assert result["exact"] == result["token_acc"] == 1.0 and result["examples"] == 60
  assert set(result["exact_by_ops"]) == {"4", "5"}

  def last_digit_wrong(tokens_BxS, segment_ids_BxS):
    pred_BxS = _oracle(tokens_BxS, segment_ids_BxS)
    ends_B = segment_ids_BxS.sum(axis=1)  # the answer's last digit is at ends - 1
    pred_BxS[np.arange(len(ends_B)), np.maximum(ends_B - 2, 0)] = ord("x")
    return pred_BxS

  wrong = tasks_eval.score_split(last_digit_wrong, c.data, "validation", limit=20)
  assert wrong["exact"] == 0.0 and wrong["token_acc"] == pytest.approx(0.8)
  assert wrong["examples"] == 20


@pytest.mark.slow
def test_head1_predictor_matches_greedy_decoding(make_model, make_config):
  """The evaluator's padded, segment-masked forward gives the token greedy decoding gives."""
  from mtp_jax.decoding import decode
  c = make_config("parallel", 2)
  c.model.vocab_size = 259
  model, params = make_model(c)
  texts = ["+ 12345 65432=", "- * 11111 22222 00300="]
  predict = tasks_eval.head1_predictor(params, model.args)
  ids = [BYTE.encode(t) for t in texts]
  tokens_BxS = np.full((2, 32), BYTE.pad_id, np.int32)
  segment_ids_BxS = np.zeros((2, 32), np.int32)
  for b, x in enumerate(ids):
    tokens_BxS[b, :len(x)], segment_ids_BxS[b, :len(x)] = x, 1
  pred_BxS = predict(tokens_BxS, segment_ids_BxS)
  greedy = decode.plain(params, model.args, ids, max_new_tokens=1, eos_id=BYTE.eos_id,
                         pad_id=BYTE.pad_id)
  assert [pred_BxS[b, len(x) - 1] for b, x in enumerate(ids)] == greedy.tokens[:, 0].tolist()


# Heavy tier: the experiment script trained end to end (~20 s); the task generators and their
# scoring have the unit tests above.
@pytest.mark.heavy
@pytest.mark.slow
def test_small_tasks_script_end_to_end(data_dir, tmp_path):
  """experiments/small_tasks.py on a 2-run grid of 3 steps: trains through mtp_jax.sweeps.sweep,
  scores every run, writes the table, JSON and PNG; a rerun trains nothing."""
  import json
  import os
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "out"
  cmd = [sys.executable, os.path.join(repo, "experiments", "small_tasks.py"), "--root",
         str(out), "--tasks", "induction", "--sizes", "32x2", "--n_future", "1,2", "--steps", "3",
         "--parallel", "2", "--eval_limit", "8", "--json", str(out / "r.json"), "--png",
         str(out / "r.png"), "--override", f"data.dir={data_dir}",
         "--override", "data.task_train_size=300", "--override", "data.task_eval_size=60",
         "--override", "data.induction_len=31", "--override", "data.induction_pairs=3",
         "--override", "data.induction_repeats=2", "--override", "train.batch_size=4"]
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
  assert "| induction | validation acc | 32x2 |" in p.stdout
  runs = json.loads((out / "r.json").read_text())["runs"]
  assert sorted(r["n_future"] for r in runs) == [1, 2]
  assert len({r["n_params"] for r in runs}) == 1  # matched parameters across n
  assert all(0.0 <= r["eval"]["validation"]["acc"] <= 1.0 for r in runs)
  assert (out / "r.png").stat().st_size > 0
  again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert again.returncode == 0 and "2 skipped" in again.stdout, again.stdout[-2000:]
