"""A real one-node Slurm on localhost for the tests: munged, slurmctld and slurmd, every file of
theirs (config, munge key and socket, state, spool, pid files, logs) under one temp folder.
The cluster writes nothing to /etc (the packages install their own defaults there, unused):
clients and daemons find the config through SLURM_CONF and the munge socket through
slurm.conf's AuthInfo.

    python tests/slurm/cluster.py          # start one, print `export SLURM_CONF=...`, wait for
                                           # Ctrl-C or SIGTERM, stop it
    with SlurmCluster() as cluster:        # cluster.env: os.environ + SLURM_CONF
      subprocess.run(["srun", "-n", "2", "hostname"], env=cluster.env)

`ensure_installed` installs Debian's slurm-wlm and munge with apt-get where a daemon or client
is missing (as root; idempotent). `SlurmCluster.start` raises `SlurmUnavailable` with the
daemons' last log lines when something does not come up; `stop` ends the three daemons by
their pid files (SIGTERM, then SIGKILL) and is safe to call twice, from atexit too.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "squeue", "scancel", "sinfo", "scontrol")
PACKAGES = ("slurm-wlm", "munge")
NODE = "localhost"
PARTITION = "debug"
# The daemons live in /usr/sbin, which a non-login shell's PATH may lack.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


class SlurmUnavailable(RuntimeError):
  """Slurm could not be installed or started here; the message says why."""


def which(program: str) -> str | None:
  return shutil.which(program, path=_SEARCH_PATH)


def missing() -> list[str]:
  return [p for p in DAEMONS + CLIENTS if which(p) is None]


def ensure_installed(log=print) -> None:
  """apt-get installs slurm-wlm and munge when one of their programs is missing (root only;
  no prompt, no service started where policy-rc.d says so, as in a container)."""
  if not missing():
    return
  if os.geteuid() != 0 or which("apt-get") is None:
    raise SlurmUnavailable(f"{', '.join(missing())} not installed, and this is not a root "
                           "Debian/Ubuntu where apt-get could install slurm-wlm and munge")
  env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
  t0 = time.time()
  for cmd in (["apt-get", "update", "-qq"],
              ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
    p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=600)
    if p.returncode != 0:
      raise SlurmUnavailable(f"{' '.join(cmd)} failed ({p.returncode}):\n"
                             f"{(p.stdout + p.stderr)[-2000:]}")
  if missing():
    raise SlurmUnavailable(f"installed {' '.join(PACKAGES)}, still missing {missing()}")
  log(f"slurm: installed {' '.join(PACKAGES)} in {time.time() - t0:.1f} s")


def free_ports(n: int) -> list[int]:
  """n TCP ports free on localhost now (all held open until every one is picked)."""
  socks = []
  try:
    for _ in range(n):
      s = socket.socket()
      s.bind(("127.0.0.1", 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def real_memory_mb() -> int:
  """MemTotal in MiB, the figure slurmd itself reports (`slurmd -C`)."""
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemTotal:"):
        return int(line.split()[1]) // 1024
  raise SlurmUnavailable("no MemTotal in /proc/meminfo")


def slurm_conf(root: str, ctld_port: int, slurmd_port: int, cpus: int, memory_mb: int) -> str:
  p = lambda *parts: os.path.join(root, *parts)
  return "\n".join([
      "ClusterName=mtpjax",
      f"SlurmctldHost={NODE}",
      f"SlurmctldPort={ctld_port}",
      f"SlurmdPort={slurmd_port}",
      "SlurmUser=root",
      "SlurmdUser=root",
      "AuthType=auth/munge",
      "CredType=cred/munge",
      f"AuthInfo=socket={p('munge', 'munge.socket')}",
      f"StateSaveLocation={p('state')}",
      f"SlurmdSpoolDir={p('spool')}",
      f"SlurmctldPidFile={p('slurmctld.pid')}",
      f"SlurmdPidFile={p('slurmd.pid')}",
      f"SlurmctldLogFile={p('slurmctld.log')}",
      f"SlurmdLogFile={p('slurmd.log')}",
      f"PlugStackConfig={p('plugstack.conf')}",  # not /etc/slurm's
      "ProctrackType=proctrack/linuxproc",
      "TaskPlugin=task/none",
      "MpiDefault=none",
      "SwitchType=switch/none",
      "LaunchType=launch/slurm",
      "SchedulerType=sched/backfill",
      "SelectType=select/cons_tres",
      "SelectTypeParameters=CR_Core",
      "AccountingStorageType=accounting_storage/none",
      "JobAcctGatherType=jobacct_gather/none",
      "JobCompType=jobcomp/none",
      "MailProg=/bin/true",
      "ReturnToService=2",
      "SlurmctldDebug=info",
      "SlurmdDebug=info",
      "SlurmctldTimeout=30",
      "SlurmdTimeout=30",
      "InactiveLimit=0",
      "KillWait=30",  # SIGTERM to SIGKILL on scancel: a training run saves its checkpoint
      "MinJobAge=300",
      "MaxArraySize=1001",
      f"NodeName={NODE} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
      f"PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
      ""])


def _tail(path: str, lines: int = 15) -> str:
  try:
    with open(path, errors="replace") as f:
      return "\n".join(f.read().splitlines()[-lines:])
  except OSError:
    return "(no log)"


def _pid_alive(pid: int, name: str) -> bool:
  """pid runs `name` (a recycled pid running something else does not count)."""
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      argv0 = f.read().split(b"\0")[0].decode(errors="replace")
  except OSError:
    return False
  return os.path.basename(argv0) == name


class SlurmCluster:
  """munged + slurmctld + slurmd on localhost under `root` (a new temp folder by default)."""

  def __init__(self, root: str | None = None, cpus: int | None = None, log=print):
    self._own_root = root is None  # removed by stop()
    self.root = root or tempfile.mkdtemp(prefix="mtp_jax_slurm_")
    self.cpus = cpus or len(os.sched_getaffinity(0))
    self.conf = os.path.join(self.root, "slurm.conf")
    self.log = log
    self._procs: dict[str, subprocess.Popen] = {}
    self._stopped = False

  @property
  def env(self) -> dict[str, str]:
    return dict(os.environ, SLURM_CONF=self.conf, PATH=_SEARCH_PATH)

  def path(self, *parts: str) -> str:
    return os.path.join(self.root, *parts)

  def _run(self, *cmd: str, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run([which(cmd[0]) or cmd[0], *cmd[1:]], env=self.env, text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=timeout)

  def _start(self, name: str, *args: str) -> None:
    """A daemon in the foreground, in a session of its own (a terminal's Ctrl-C does not reach
    it); NAME.out gets its stdout and stderr (munged's messages in the foreground)."""
    with open(self.path(f"{name}.out"), "ab") as out:
      self._procs[name] = subprocess.Popen([which(name), *args], stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=self.env, start_new_session=True)

  def _wait(self, what: str, ready, timeout: float, logs: tuple[str, ...]) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
      if ready():
        return
      for name, proc in self._procs.items():
        if proc.poll() is not None:
          raise SlurmUnavailable(f"{name} exited ({proc.returncode}) while waiting for {what}:\n"
                                 + self.logs(logs))
      time.sleep(0.1)
    raise SlurmUnavailable(f"{what}: not within {timeout:.0f} s:\n" + self.logs(logs))

  def logs(self, names: tuple[str, ...] = ("munged", "slurmctld", "slurmd")) -> str:
    files = {"munged": ["munge/munged.log", "munged.out"]}
    return "\n".join(f"--- {f}\n{_tail(self.path(f))}" for n in names
                     for f in files.get(n, [f"{n}.log", f"{n}.out"]))

  def start(self, timeout: float = 60) -> SlurmCluster:
    if os.geteuid() != 0:
      raise SlurmUnavailable("the test cluster runs munged, slurmctld and slurmd as root "
                             "(SlurmUser=root); this is not root")
    ensure_installed(self.log)
    t0 = time.time()
    atexit.register(self.stop)
    munge = self.path("munge")
    for d in ("munge", "state", "spool"):
      os.makedirs(self.path(d), mode=0o700, exist_ok=True)
    os.chmod(self.root, 0o700)  # munged refuses a key or socket under a group/world-writable dir
    key = os.path.join(munge, "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400), "wb") as f:
      f.write(os.urandom(1024))
    ctld_port, slurmd_port = free_ports(2)
    with open(self.conf, "w") as f:
      f.write(slurm_conf(self.root, ctld_port, slurmd_port, self.cpus, real_memory_mb()))
    open(self.path("plugstack.conf"), "w").close()

    self._start("munged", "--foreground", "--force", f"--socket={munge}/munge.socket",
                f"--key-file={key}", f"--pid-file={munge}/munged.pid",
                f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed")
    self._wait("munged's socket", lambda: os.path.exists(f"{munge}/munge.socket"), 15,
               ("munged",))
    self._start("slurmctld", "-D", "-i", "-f", self.conf)
    self._wait("slurmctld", lambda: self._run("scontrol", "ping").returncode == 0, timeout,
               ("munged", "slurmctld"))
    self._start("slurmd", "-D", "-f", self.conf, "-N", NODE)
    self._wait(f"node {NODE} idle in sinfo", self._node_idle, timeout, DAEMONS)
    self.log(f"slurm: {NODE} idle ({self.cpus} CPUs) in {time.time() - t0:.1f} s; "
             f"SLURM_CONF={self.conf}")
    return self

  def _node_idle(self) -> bool:
    p = self._run("sinfo", "-h", "-N", "-n", NODE, "-o", "%t")
    return p.returncode == 0 and p.stdout.strip() == "idle"

  def cancel_all(self, timeout: float = 40) -> None:
    """scancel every job, and wait (bounded) for the queue to empty of running ones."""
    if self._run("scontrol", "ping").returncode != 0:
      return
    self._run("scancel", "--partition", PARTITION)
    deadline = time.time() + timeout
    while time.time() < deadline:
      p = self._run("squeue", "-h", "-t", "PENDING,RUNNING,COMPLETING,SUSPENDED", "-o", "%i")
      if p.returncode != 0 or not p.stdout.strip():
        return
      time.sleep(0.5)

  def stop(self) -> None:
    """Cancels the jobs, then ends slurmd, slurmctld and munged (each by its pid file, or the
    pid it was started with): SIGTERM, SIGKILL after 10 s; removes the temp folder it made.
    Idempotent."""
    if self._stopped:
      return
    self._stopped = True
    if "slurmd" in self._procs and self._procs["slurmd"].poll() is None:
      with contextlib.suppress(Exception):
        self.cancel_all()
    pid_files = {"slurmd": "slurmd.pid", "slurmctld": "slurmctld.pid",
                 "munged": "munge/munged.pid"}
    for name in ("slurmd", "slurmctld", "munged"):
      pids = {self._procs[name].pid} if name in self._procs else set()
      with contextlib.suppress(OSError, ValueError):
        with open(self.path(pid_files[name])) as f:
          pids.add(int(f.read().split()[0]))
      for pid in pids:
        if _pid_alive(pid, name):
          with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
      deadline = time.time() + 10
      while time.time() < deadline and any(_pid_alive(p, name) for p in pids):
        if name in self._procs:
          self._procs[name].poll()  # reap our child
        time.sleep(0.1)
      for pid in pids:
        if _pid_alive(pid, name):
          with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
      if name in self._procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
          self._procs[name].wait(5)
    if self._own_root:
      shutil.rmtree(self.root, ignore_errors=True)
    with contextlib.suppress(Exception):
      atexit.unregister(self.stop)

  def __enter__(self) -> SlurmCluster:
    try:
      return self.start()
    except BaseException:
      self.stop()
      raise

  def __exit__(self, *exc) -> None:
    self.stop()


def main() -> int:
  try:
    cluster = SlurmCluster().__enter__()
  except SlurmUnavailable as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"export SLURM_CONF={cluster.conf}\n(Ctrl-C or SIGTERM stops the cluster)", flush=True)

  def stop(*_):
    raise KeyboardInterrupt
  for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # (SIGINT: ignored under nohup &)
    signal.signal(s, stop)
  try:
    signal.pause()
  except KeyboardInterrupt:
    pass
  finally:
    cluster.stop()
  return 0


if __name__ == "__main__":
  sys.exit(main())
