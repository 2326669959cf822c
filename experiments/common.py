"""What the experiment scripts share: `--set key=value` config overrides, the compiled-memory
record of a step, and a random batch for a train step built by `steps.build_training`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from mtp_jax import cli


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Worker:
  """A benchmark side in a process of its own (`cmd`, `env`, started in `cwd`), spoken to in
  lines: its first stdout line says it is ready (`ready`, parsed JSON); `call(line)` sends one
  request line and returns the JSON line it answers; `close()` sends "quit" and waits."""

  def __init__(self, cmd: list[str], env: dict, cwd: str | None, name: str):
    self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env, cwd=cwd)
    line = self.p.stdout.readline()
    if not line:
      raise RuntimeError(f"the {name} worker failed to start (its error is above)")
    self.ready = json.loads(line)

  def call(self, request: str) -> dict:
    self.p.stdin.write(request + "\n")
    self.p.stdin.flush()
    line = self.p.stdout.readline()
    if not line:
      raise RuntimeError("a worker died (its error is above)")
    return json.loads(line)

  def close(self):
    self.p.stdin.write("quit\n")
    self.p.stdin.close()
    self.p.wait()


def module_command(module: str, env=None, tree: str | None = None) -> tuple[list[str], dict]:
  """(argv, environment) that run `python -m experiments.<module>` in a child process from any
  folder: the repository root leads PYTHONPATH. `tree`: another checkout of this repository
  (`--ref_tree`), whose code then leads it instead (start the child in that folder too)."""
  env = dict(os.environ if env is None else env)
  lead = [os.path.abspath(tree)] if tree else []
  env["PYTHONPATH"] = os.pathsep.join(lead + [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
  return [sys.executable, "-m", f"experiments.{module}"], env


def one_core_before_jax() -> None:
  """This process on one CPU (the lowest it may use), so XLA:CPU's thread pool has one thread
  and each op, dots included, runs in line: call it before JAX starts (profile_train,
  step_faults --one_core). (`xla_cpu_multi_thread_eigen=false` does not do it: jaxlib 0.10's
  thunk runtime threads a dot over the pool whatever the flag says.)"""
  os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def is_checkout(tree: str, module: str) -> bool:
  """Whether folder `tree` is a checkout of this repository holding experiments/<module>.py."""
  return os.path.isfile(os.path.join(tree, "experiments", f"{module}.py"))


def add_flag_table(parser, flags, smoke: dict) -> None:
  """--NAME for each (name, default, help) of `flags` (typed by the default), and --smoke, whose
  tiny settings `apply_smoke` applies."""
  for name, default, help_ in flags:
    parser.add_argument(f"--{name}", type=type(default), default=default, help=help_)
  parser.add_argument("--smoke", action="store_true", help=f"tiny settings: {smoke}")


def apply_smoke(parser, args, smoke: dict) -> None:
  """With --smoke, `smoke`'s settings for every flag the command line left at its default."""
  for k, v in smoke.items() if args.smoke else ():
    if getattr(args, k) == parser.get_default(k):
      setattr(args, k, v)


def merged_result(results: list, heads: int):
  """Several decoding calls' DecodeResults as one (rows concatenated, histograms and forwards
  added): a and alpha_j over every call of a cell."""
  from mtp_jax.decoding import decode as decode_lib
  return decode_lib.DecodeResult(
      **{f: np.concatenate([getattr(r, f) for r in results]) for f in ("tokens", "lengths",
                                                                      "cycles")},
      accepted_hist=np.sum([r.accepted_hist for r in results], 0),
      forwards=sum(r.forwards for r in results), heads=heads)


def positive_ints(parser, flag: str, text: str) -> list[int]:
  """A comma-separated list of positive integers (`--batches 1,2,8`), or the parser's one-line
  error naming `flag`."""
  try:
    values = [int(v) for v in text.split(",")]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    parser.error(f"{flag}: comma-separated positive integers, got {text!r}")
  return values


def parse_cpus(text: str) -> set[int]:
  """--cpus "0", "0,1", "0-3" -> {CPU numbers}; ValueError names the flag and what is allowed."""
  if not text:
    return set()
  cpus = set()
  try:
    for part in text.split(","):
      lo, _, hi = part.partition("-")
      cpus.update(range(int(lo), int(hi or lo) + 1))
  except ValueError:
    raise ValueError(f"--cpus: a list like 0 or 0,1 or 0-3, got {text!r}") from None
  allowed = os.sched_getaffinity(0)
  if not cpus or not cpus <= allowed:
    raise ValueError(f"--cpus: CPUs this process may use are {sorted(allowed)}, got {text!r}")
  return cpus


def loaded_workdir(parser, workdir: str):
  """`workdir.load_workdir(workdir)`, or the parser's error where the folder does not exist."""
  if not os.path.isdir(workdir):
    parser.error(f"--workdir: no such directory: {workdir}")
  from mtp_jax.workdir import load_workdir
  return load_workdir(workdir)


def rotated(order: list, i: int) -> list:
  """`order` starting at its (i mod n)-th item: round i of an interleaved benchmark, so that no
  run always follows the same other one."""
  return order[i % len(order):] + order[:i % len(order)]


def same_round(ref_s, new_s) -> tuple[float, list[float]]:
  """(median, [25th, 75th percentile]) of ref / new seconds, round by round: the new code's
  speed over the reference's."""
  ratio = np.asarray(ref_s) / np.asarray(new_s)
  return float(np.median(ratio)), np.quantile(ratio, [0.25, 0.75]).tolist()


def write_json(record, path: str | None, indent: int = 2) -> str:
  """`record` stamped with the machine it ran on (`stamp`) as JSON text, written to
  `path` (its folder made) when given; returns the text."""
  text = json.dumps(stamp(record), indent=indent)
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      f.write(text + "\n")
  return text


def emit(record, path: str | None, indent: int = 2) -> None:
  """Prints `record` as stamped JSON (what every script's output is) and writes it to `path`."""
  print(write_json(record, path, indent))


def parse_overrides(items) -> dict[str, str]:
  """["model.d_model=64", ...] -> {"model.d_model": "64"}; ValueError naming --set on an item
  without "="."""
  bad = [kv for kv in items if "=" not in kv]
  if bad:
    raise ValueError(f"--set: expected KEY=VALUE, got {bad[0]!r}")
  return dict(kv.split("=", 1) for kv in items)


def apply_overrides(config, overrides) -> None:
  """Sets each dotted field (a dict from `parse_overrides`, or its list of items), the value
  parsed by the field's type ("False" is False); ValueError names --set and the field."""
  if not isinstance(overrides, dict):
    overrides = parse_overrides(overrides)
  for key, value in overrides.items():
    try:
      cli.set_field(config, key.strip(), value.strip())
    except ValueError as e:
      raise ValueError(f"--set: {e}") from None


def memory_record(compiled) -> dict:
  """`compiled.memory_analysis()` per device, in bytes, with peak_bytes = arguments +
  temporaries + outputs that do not reuse a donated argument (an upper bound; XLA's own
  peak_memory_in_bytes, kept beside it, came out barely above the arguments alone on the CPU
  backend)."""
  m = compiled.memory_analysis()
  out = {"argument_bytes": int(m.argument_size_in_bytes),
         "output_bytes": int(m.output_size_in_bytes),
         "alias_bytes": int(m.alias_size_in_bytes),
         "temp_bytes": int(m.temp_size_in_bytes)}
  out["peak_bytes"] = (out["argument_bytes"] + out["temp_bytes"]
                       + max(out["output_bytes"] - out["alias_bytes"], 0))
  out["xla_peak_memory_bytes"] = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
  return out


def random_batch(config, seed: int = 0, high: int | None = None) -> dict:
  """{"tokens": ids uniform in [0, high or model.vocab_size), "segment_ids": ones}, int32
  [train.batch_size, data.seq_len], on the host."""
  rng = np.random.default_rng(seed)
  B, S = config.train.batch_size, config.data.seq_len
  high = config.model.vocab_size if high is None else high
  return {"tokens": rng.integers(0, high, (B, S)).astype(np.int32),
          "segment_ids": np.ones((B, S), np.int32)}


def machine_info(accelerator: bool = True) -> dict:
  """The machine a figure was measured on, for every bench record: CPU model, the ISA flags
  that change XLA:CPU's kernels (AVX2, AVX-512, AMX), core count, and the accelerator JAX runs
  on (platform, device kind, count; starts JAX's backend unless accelerator=False)."""
  import platform
  from mtp_jax import hostinfo
  info = {"cpu_model": hostinfo.cpu_model_name(), "isa": hostinfo.isa(),
          "cpu_count": os.cpu_count(), "arch": platform.machine()}
  vendor, family, model_id = hostinfo.cpu_ids()
  if family is not None or model_id is not None:
    info["cpu_vendor"], info["cpu_family"], info["cpu_model_id"] = vendor, family, model_id
  if accelerator:
    import jax
    devices = jax.devices()
    info["accelerator"] = {"platform": devices[0].platform,
                           "device_kind": devices[0].device_kind, "count": len(devices)}
  return info


def stamp(record):
  """`record` (a dict, or a list of dicts: one bench record each) with "machine":
  machine_info() added to every dict that lacks it (read only then: it starts JAX's backend);
  returned for json.dump."""
  lacking = [r for r in ([record] if isinstance(record, dict) else record)
             if isinstance(r, dict) and "machine" not in r]
  if lacking:
    info = machine_info()
    for r in lacking:
      r["machine"] = info
  return record
