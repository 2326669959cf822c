"""Stop sequences inside the decode loop (mtp_jax.decoding.stops): the automaton on hand-worked
cases, the in-loop cut equal to code_tasks.truncate's post-hoc cut on random texts, and decode rows
that stop early with the same completions as full-length decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.evaluation import code_tasks
from mtp_jax.decoding import stops
from mtp_jax.data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
TABLE = stops.token_bytes(TOK, TOK.vocab_size)
feed, finished = jax.jit(stops.feed), jax.jit(stops.finished)


def run_text(stop_set, text: str, k: int = 1):
  """Feeds text's bytes k tokens per call (as a decode cycle does); the number of bytes fed
  when the row first counts as finished (None: never) and the final state."""
  m = stops.build(stop_set, *TABLE)
  ids = TOK.encode(text)
  st = stops.init(1)
  for start in range(0, len(ids), k):
    chunk = ids[start:start + k]
    toks = np.full((1, k), TOK.eos_id, np.int32)
    toks[0, :len(chunk)] = chunk
    st = feed(m, st, jnp.asarray(toks), jnp.asarray([len(chunk)]))
    if bool(finished(m, st)[0]):
      return start + len(chunk), st
  return None, st


def test_automaton_by_hand():
  m = stops.build(("ab", "b"), *TABLE)
  # nodes: 0 root, 1 "a", 2 "ab", 3 "b"; "ab" ends with "b": both end at node 2
  assert m.depth_N.tolist() == [0, 1, 2, 1] and m.match_N.tolist() == [0, 0, 2, 1]
  assert m.goto_NxA[1, ord("b")] == 2 and m.goto_NxA[2, ord("a")] == 1
  assert m.goto_NxA[2, ord("b")] == 3 and m.goto_NxA[3, ord("x")] == 0
  with pytest.raises(ValueError, match="ASCII"):
    stops.build(("\ndéf",), *TABLE)


@pytest.mark.parametrize("text, at, cut", [
    ("    return 1\n\ndef g():", 17, 13),   # "\ndef" at 13..16: complete after 17 bytes
    ("    x = 1\n# note\nprint(x)", 11, 9),  # "\n#" at 9
    ("    return 2\n", None, None),         # no stop: decode to the end
    ("    if x:\n        y\nif", 22, 19),   # "\nif" at line start only
])
def test_humaneval_stops_by_hand(text, at, cut):
  done, st = run_text(code_tasks.HUMANEVAL_STOPS, text)
  assert done == at
  if cut is not None:
    assert int(st.cut_B[0]) == cut and code_tasks.truncate(text, code_tasks.HUMANEVAL_STOPS) \
        == text[:cut]


def test_overlapping_stops_wait_for_the_earliest_start():
  # "bc" is complete after "abc", but an "abcd" starting at 0 may still come: not finished
  assert run_text(("abcd", "bc"), "abc")[0] is None
  assert run_text(("abcd", "bc"), "abcd")[0] == 4 and run_text(("abcd", "bc"), "abcx")[0] == 4
  done, st = run_text(("abcd", "bc"), "abcd")
  assert int(st.cut_B[0]) == 0  # truncate("abcd...") == ""
  done, st = run_text(("abcd", "bc"), "abcxyz")
  assert done == 4 and int(st.cut_B[0]) == 1  # truncate == "a"


@pytest.mark.parametrize("k", [1, 3])
def test_in_loop_cut_equals_the_post_hoc_cut_on_random_texts(k):
  rng = np.random.default_rng(0)
  sets = [code_tasks.HUMANEVAL_STOPS, code_tasks.MBPP_STOPS, ("abcd", "bc", "cda"),
          ("aa", "aaa", "ab")]
  alphabet = list("abcd\n#ief") + ['"']
  for trial in range(60):
    stop_set = sets[trial % len(sets)]
    text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 40))))
    if trial % 3 == 0:  # plant a stop
      s = stop_set[int(rng.integers(len(stop_set)))]
      i = int(rng.integers(len(text) + 1))
      text = text[:i] + s + text[i:]
    done, _ = run_text(stop_set, text, k)
    full = code_tasks.truncate(text, stop_set)
    if done is not None:
      # what the loop kept (the bytes up to its stop, cut post hoc) == the full text's cut
      assert code_tasks.truncate(text[:done], stop_set) == full, (stop_set, text, done)
      assert len(full) < len(text)
    if len(full) < len(text) and done is None:
      # never finished: only possible when the text ends while an earlier stop is still open
      m = stops.build(stop_set, *TABLE)
      _, st = run_text(stop_set, text, k)
      assert int(st.len_B[0]) - int(m.depth_N[int(st.node_B[0])]) < int(st.cut_B[0])


def test_other_tokenizers_keep_the_post_hoc_cut_only():
  class Other:
    vocab_size = 10
  assert stops.token_bytes(Other(), 10) is None


@pytest.fixture(scope="module")
def byte_model(make_config, make_model):
  c = make_config("parallel", n_future=2)
  c.model.vocab_size, c.model.max_len = TOK.vocab_size, 64
  model, params = make_model(c)
  return model.args, params


@pytest.mark.slow
@pytest.mark.parametrize("k, temperature", [(1, 0.0), (2, 0.0), (2, 1.0)])
def test_decode_stops_rows_early_with_the_same_cut(byte_model, k, temperature):
  from mtp_jax.decoding import decode
  args, params = byte_model
  prompts = [TOK.encode(t) for t in ("def f(x):\n", "class A:\n", "x = [", "# a\n")]
  kw = dict(max_new_tokens=40, k=k, eos_id=TOK.eos_id, pad_id=TOK.pad_id,
            temperature=temperature, seed=5)
  full = decode.decode(params, args, prompts, **kw)
  texts = [TOK.decode(full.tokens[b, :full.lengths[b]]) for b in range(len(prompts))]
  # stop strings the random model does write: two ASCII characters from the middle of rows 0, 1
  stop_set = []
  for t in texts[:2]:
    pairs = [t[i:i + 2] for i in range(5, len(t) - 2) if t[i:i + 2].isascii()]
    assert pairs, t
    stop_set.append(pairs[0])
  m = stops.build(tuple(stop_set), *TABLE)
  cut = decode.decode(params, args, prompts, stops=m, **kw)
  for b in range(len(prompts)):
    short = TOK.decode(cut.tokens[b, :cut.lengths[b]])
    assert code_tasks.truncate(short, stop_set) == code_tasks.truncate(texts[b], stop_set)
    assert np.array_equal(cut.tokens[b, :cut.lengths[b]], full.tokens[b, :cut.lengths[b]])
  assert (cut.lengths[:2] < full.lengths[:2]).all()  # rows 0 and 1 stopped early
