"""Speculative == greedy, token for token, under XLA's default optimisations.

Every other test compiles with `--xla_backend_optimization_level=0` and no fusion emitters
(tests/conftest.py: ~7x faster compiles). Exactness rests on head 1's logits in a k-token window
being bit-equal to those of one-token steps, which an optimising compiler could break (a
different fusion or matmul tiling for k tokens than for one); so the check runs once more here,
in a subprocess started without those flags (MTP_JAX_TEST_FAST_COMPILE=0), for every head kind
and both dtypes, small enough to compile in a few seconds each. Four (kind, dtype) cases, not
all six: every kind and every dtype appear, parallel in both dtypes (unoptimised compiles are
~7x slower, and f32 / bf16 projection and sequential cases add no code path the four lack).
Then once more with the CPU defaults' XLA_FLAGS (runtime.CPU_XLA_FLAGS, what the CLIs run
with): there a decoding program of 2+ rows compiles with YNNPACK's dots back
(runtime.decode_compiler_options) and one of 1 row without them (with them too on the CPUs of
runtime.YNN_ONE_ROW_CPUS), so both are checked in bf16 on most machines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROWS = [0, 1, 2, 3]  # the prompts of a case (of lengths 3, 1, 9, 5)
CASES = (("parallel", "float32", ROWS), ("parallel", "bfloat16", ROWS),
         ("projection", "bfloat16", ROWS), ("sequential", "float32", ROWS))
CPU_DEFAULTS_CASES = (("parallel", "bfloat16", ROWS), ("parallel", "bfloat16", [2]),
                      ("parallel", "bfloat16", ROWS, "2,1"))

CHECK = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import conftest  # MTP_JAX_TEST_FAST_COMPILE=0: leaves XLA_FLAGS alone
flags = os.environ.get("XLA_FLAGS", "")
assert "optimization_level" not in flags and "fusion_emitters" not in flags, flags
import numpy as np
from mtp_jax.backends.cpu import runtime
from mtp_jax.decoding import decode
out = {"xla_flags": flags, "cases": []}
CASES = json.loads(sys.argv[2])
rng = np.random.default_rng(2)
all_prompts = [list(rng.integers(0, 59, n)) for n in (3, 1, 9, 5)]
for kind, dtype, rows, *tree in CASES:
  prompts = [all_prompts[i] for i in rows]
  c = conftest.tiny_config(kind, n_future=3)
  c.model.dtype, c.model.max_len = dtype, 64
  model, params = conftest.tiny_model(c, seed=3)
  kw = dict(max_new_tokens=40, eos_id=60, pad_id=59)
  g = decode.plain(params, model.args, prompts, **kw)
  s = decode.decode(params, model.args, prompts, k=3, tree=tree[0] if tree else None, **kw)
  out["cases"].append({"kind": kind, "dtype": dtype, "rows": rows, "tree": s.tree,
                       "options": runtime.decode_compiler_options(len(rows)),
                       "equal": bool(np.array_equal(g.tokens, s.tokens)
                                     and np.array_equal(g.lengths, s.lengths)),
                       "longest": int(g.lengths.max()),
                       "drafts_accepted": int(s.accepted_hist[1:].sum())})
print("RESULT" + json.dumps(out))
"""


def _check(cases, cpu_defaults: bool):
  from mtp_jax.backends.cpu import runtime
  env = dict(os.environ, MTP_JAX_TEST_FAST_COMPILE="0", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  flags = [f for f in env.get("XLA_FLAGS", "").split()  # this process's conftest added them
           if not f.startswith(("--xla_backend_optimization_level", "--xla_cpu_use_fusion"))]
  env["XLA_FLAGS"] = " ".join(flags)
  if cpu_defaults:
    env["XLA_FLAGS"] = runtime.merged_xla_flags(env["XLA_FLAGS"])
  p = subprocess.run([sys.executable, "-c", CHECK, ROOT, json.dumps(cases)], env=env, cwd=ROOT,
                     capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  out = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT")][-1][6:])
  assert [[c["kind"], c["dtype"], c["rows"]] for c in out["cases"]] == [list(c[:3]) for c in cases]
  assert [c["tree"] is not None for c in out["cases"]] == [len(c) > 3 for c in cases]
  for case in out["cases"]:
    assert case["equal"], case
    assert case["drafts_accepted"] > 0, case  # not vacuous
    assert case["longest"] == 40, case
  return out["cases"]


# Heavy tier: jaxlib's own flags (~35 s of optimised compiles); the CLIs' flags (the next test, the
# ones users run) stay in make test.
@pytest.mark.heavy
@pytest.mark.slow
def test_speculative_equals_greedy_with_default_compiler_flags():
  for case in _check(CASES, cpu_defaults=False):
    assert case["options"] is None, case  # jaxlib's own flags: nothing to add


@pytest.mark.slow
def test_speculative_equals_greedy_with_cpu_defaults():
  """The CLIs' flags: batch 4 with YNNPACK's dots (options given; a chain and a tree), batch 1
  without (with, on the CPUs of runtime.YNN_ONE_ROW_CPUS)."""
  from mtp_jax.backends.cpu import runtime
  ynn = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
                                                  "LIBRARY_FUSION_TYPE_REDUCE"}
  one_row = ynn if runtime.ynn_one_row() else None
  assert [c["options"] for c in _check(CPU_DEFAULTS_CASES, cpu_defaults=True)] == [ynn, one_row,
                                                                                  ynn]
