"""Speculative == greedy, token for token, under XLA's default optimisations.

Every other test compiles with `--xla_backend_optimization_level=0` and no fusion emitters
(tests/conftest.py: ~7x faster compiles). Exactness rests on head 1's logits in a k-token window
being bit-equal to those of one-token steps, which an optimising compiler could break (a
different fusion or matmul tiling for k tokens than for one); so the check runs once more here,
in a subprocess started without those flags (MTP_JAX_TEST_FAST_COMPILE=0), for every head kind
and both dtypes, small enough to compile in a few seconds each. Four (kind, dtype) cases, not
all six: every kind and every dtype appear, parallel in both dtypes (unoptimised compiles are
~7x slower, and f32 / bf16 projection and sequential cases add no code path the four lack)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = (("parallel", "float32"), ("parallel", "bfloat16"), ("projection", "bfloat16"),
         ("sequential", "float32"))

CHECK = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import conftest  # MTP_JAX_TEST_FAST_COMPILE=0: leaves XLA_FLAGS alone
flags = os.environ.get("XLA_FLAGS", "")
assert "optimization_level" not in flags and "fusion_emitters" not in flags, flags
import numpy as np
from mtp_jax.decoding import decode
out = {"xla_flags": flags, "cases": []}
CASES = json.loads(sys.argv[2])
rng = np.random.default_rng(2)
prompts = [list(rng.integers(0, 59, n)) for n in (3, 1, 9, 5)]
for kind, dtype in CASES:
  c = conftest.tiny_config(kind, n_future=3)
  c.model.dtype, c.model.max_len = dtype, 64
  model, params = conftest.tiny_model(c, seed=3)
  kw = dict(max_new_tokens=40, eos_id=60, pad_id=59)
  g = decode.plain(params, model.args, prompts, **kw)
  s = decode.decode(params, model.args, prompts, k=3, **kw)
  out["cases"].append({"kind": kind, "dtype": dtype,
                       "equal": bool(np.array_equal(g.tokens, s.tokens)
                                     and np.array_equal(g.lengths, s.lengths)),
                       "longest": int(g.lengths.max()),
                       "drafts_accepted": int(s.accepted_hist[1:].sum())})
print("RESULT" + json.dumps(out))
"""


def test_speculative_equals_greedy_with_default_compiler_flags():
  env = dict(os.environ, MTP_JAX_TEST_FAST_COMPILE="0", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  flags = [f for f in env.get("XLA_FLAGS", "").split()  # this process's conftest added them
           if not f.startswith(("--xla_backend_optimization_level", "--xla_cpu_use_fusion"))]
  env["XLA_FLAGS"] = " ".join(flags)
  p = subprocess.run([sys.executable, "-c", CHECK, ROOT, json.dumps(CASES)], env=env, cwd=ROOT,
                     capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  out = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT")][-1][6:])
  assert [[c["kind"], c["dtype"]] for c in out["cases"]] == [list(c) for c in CASES]
  for case in out["cases"]:
    assert case["equal"], case
    assert case["longest"] == 40 and case["drafts_accepted"] > 0, case  # not vacuous
