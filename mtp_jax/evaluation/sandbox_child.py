"""The first code of a sandboxed child (`python -I -S -c <this file's text> CONFIG`), not imported.

In order: rlimits; the marker nonce read from a pipe; when the evaluator is root, setgroups,
setgid, setuid to the program's own unprivileged uid (the Python installation, which that uid
may not be allowed to traverse to, stays reachable through a directory descriptor opened
before); no_new_privs; Landlock (reads: the installation, its shared-library directories,
/dev/null, /dev/urandom and the program's directory; writes: that directory only; no TCP bind or
connect; no signals or abstract unix sockets outside the sandbox); seccomp (no fork, exec,
sockets of any family, ptrace, io_uring); then the program, and after it returns the marker.
"""

import json
import os
import resource
import sys

cfg = json.loads(sys.argv[1])
sys.argv[1:] = []
for _name, _soft, _hard in cfg["rlimits"]:
  resource.setrlimit(getattr(resource, _name), (_soft, _hard))


def _setup(cfg):
  """Returns (nonce, marker fd) after dropping privileges and installing the filters."""
  import ctypes
  import struct
  libc = ctypes.CDLL(None, use_errno=True)

  def check(ok, what):
    if not ok:
      err = ctypes.get_errno()
      sys.stderr.write(f"\nsandbox setup failed: {what}: {os.strerror(err)}\n")
      os._exit(120)

  nonce = os.read(cfg["nonce_fd"], 64)
  os.close(cfg["nonce_fd"])
  check(len(nonce) == 32, "marker nonce")
  # Descriptors for every rule, opened while the path is still reachable (before the uid drop).
  install = os.path.realpath(sys.base_prefix)
  libdirs = set()
  with open("/proc/self/maps") as f:
    for line in f:
      path = line.split(None, 5)[-1].strip()
      if path.startswith("/") and ".so" in os.path.basename(path) and os.path.exists(path):
        libdirs.add(os.path.dirname(os.path.realpath(path)))
  read = [install] + sorted(d for d in libdirs if not d.startswith(install + os.sep))
  rfd = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in read}
  files = [(p, os.open(p, os.O_PATH)) for p in ("/dev/null", "/dev/urandom", "/etc/ld.so.cache")
           if os.path.exists(p)]
  here = os.open(".", os.O_PATH | os.O_DIRECTORY)
  if cfg["uid"] is not None:
    fd = rfd[install]
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    check(os.getuid() == os.geteuid() == cfg["uid"] and os.getgroups() == [], "drop to uid")
    alias = f"/proc/self/fd/{fd}"

    def via_fd(paths):
      return [alias + p[len(install):] if p == install or p.startswith(install + os.sep)
              else p for p in (os.path.realpath(q) for q in paths)]

    sys.path[:] = via_fd(sys.path)
    for mod in list(sys.modules.values()):  # packages imported so far find submodules by path
      if isinstance(getattr(mod, "__path__", None), list):
        mod.__path__[:] = via_fd(mod.__path__)
    sys.path_importer_cache.clear()
  check(libc.prctl(38, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS")
  abi = cfg["landlock"]
  if abi:
    ex, wr, rd, rdir = 1, 2, 4, 8
    fs = 0x1fff | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    fs |= 1 << 15 if abi >= 5 else 0  # IOCTL_DEV
    attr = struct.pack("=QQQ", fs, 0x3 if abi >= 4 else 0, 0x3 if abi >= 6 else 0)
    attr = attr[:8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(444, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    check(ruleset >= 0, "landlock_create_ruleset")

    def allow(access, fd, what):
      rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
      check(libc.syscall(445, ruleset, 1, rule, ctypes.c_uint32(0)) == 0, "landlock rule " + what)

    allow(fs, here, "program directory")
    for p, fd in rfd.items():
      allow(ex | rd | rdir, fd, p)
    for p, fd in files:
      allow(rd | (wr if p == "/dev/null" else 0), fd, p)
    check(libc.syscall(446, ruleset, ctypes.c_uint32(0)) == 0, "landlock_restrict_self")
    os.close(ruleset)
  for fd in [here] + [fd for _, fd in files]:
    os.close(fd)
  if cfg["seccomp"]:
    arch, clone, clone3, eagain, eperm = cfg["seccomp"]
    ret = lambda v: (0x06, 0, 0, v)
    allow_all, kill = 0x7FFF0000, 0x80000000
    # load arch; not ours: kill. load nr; x32 (>= 0x40000000): EPERM; clone3: ENOSYS (libc
    # falls back to clone, checked below); listed: EAGAIN / EPERM; clone: allowed only with
    # CLONE_THREAD (a thread, not a process); everything else allowed.
    prog = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), ret(kill), (0x20, 0, 0, 0),
            (0x35, 0, 1, 0x40000000), ret(0x50000 | 1), (0x15, 0, 1, clone3), ret(0x50000 | 38)]
    for nr in eagain:
      prog += [(0x15, 0, 1, nr), ret(0x50000 | 11)]
    for nr in eperm:
      prog += [(0x15, 0, 1, nr), ret(0x50000 | 1)]
    prog += [(0x15, 0, 4, clone), (0x20, 0, 0, 16), (0x45, 0, 1, 0x10000), ret(allow_all),
             ret(0x50000 | 11), ret(allow_all)]
    filt = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *i) for i in prog))
    fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(filt))
    check(libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0, "seccomp")
  for m in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
    del sys.modules[m]
  return nonce, cfg["marker_fd"]




def _run(nonce, marker, write=os.write, exit_=os._exit, flush=sys.stdout.flush):
  with open("program.py", encoding="utf-8") as f:
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
        line = f" (line {n}: {src.splitlines()[n - 1].strip()[:200]})"
      msg = traceback.format_exception_only(type(e), e)[-1].strip()
    except BaseException:
      msg = type(e).__name__
    sys.stderr.write(f"\n{msg[:500]}{line}\n")
    sys.stderr.flush()
    exit_(1)
  try:
    flush()
  except BaseException:
    pass
  write(marker, nonce)  # the end-of-program marker: the program ran to its end
  exit_(0)


_run(*_setup(cfg))
