"""In which order XLA:CPU's collectives add a float over 4 devices: its in-process collectives,
gloo in one process (the one-process cluster `mtp_jax.distributed` starts on several CPU
devices), and gloo across 2 processes x 2 devices. Why one process on 4 CPU devices starts a
cluster of itself: float addition is not associative, so a sum over more than 2 devices rounds
by its order, and only gloo's order is the same for every process count.

    python experiments/reduction_order.py [--sizes 8,64,4096] [--json OUT]

Each arm runs in processes of its own (the device count and collectives are fixed when JAX
starts) on the same draws x[d] (d = device 0..3): psum (all-reduce) and psum_scatter
(reduce-scatter) over a data=2 x fsdp=2 mesh, and the 2-device psums over each mesh axis. Per
arm and collective the record gives the output's sha256, the share of elements equal to
((x0 + x1) + x2) + x3 and to (x0 + x1) + (x2 + x3), and per eighth of the buffer the orders it
matches; then which arms agree bit for bit. On the 2-core AMD EPYC of this project: in-process
adds in device order everywhere, gloo's all-reduce a ring (each chunk starts at another device)
and its reduce-scatter in pairs; gloo's two arms are equal, the 2-device sums equal in all three
(experiments/results/reduction_order_epyc.json).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys

from experiments import common

ARMS = ("in_process", "gloo_one_process", "gloo_two_processes")


def worker(arm: str, process_id: int, address: str, sizes: list[int]) -> dict:
  """One process of `arm`: the collectives' outputs, described (process 0's record)."""
  n = 2 if arm == "gloo_two_processes" else 1
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // n}"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  if arm != "in_process":
    jax.distributed.initialize(coordinator_address=address, num_processes=n,
                               process_id=process_id)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
  rows = P(("data", "fsdp"))
  ops = {"all_reduce_4": lambda v: jax.lax.psum(v, ("data", "fsdp")),
         "reduce_scatter_4": lambda v: jax.lax.psum_scatter(v, ("data", "fsdp"),
                                                            scatter_dimension=1, tiled=True),
         "all_reduce_2_data": lambda v: jax.lax.psum(v, "data"),
         "all_reduce_2_fsdp": lambda v: jax.lax.psum(v, "fsdp")}
  out = {}
  for size in sizes:
    x = (np.random.default_rng(size).standard_normal((4, size)) * 1.7).astype(np.float32)
    xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, rows), lambda i, x=x: x[i])
    for name, op in ops.items():
      f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=rows, out_specs=rows))
      y = np.asarray(multihost_utils.process_allgather(f(xs), tiled=True))
      rec = {"sha256": hashlib.sha256(y.tobytes()).hexdigest()}
      if name.endswith("_4"):
        y = y[0] if name.startswith("all_reduce") else y.reshape(-1)
        rec.update(describe(x, y))
      out[f"{name}/{size}"] = rec
  return out


def describe(x, y) -> dict:
  """How the 4-term sums `y` of the rows of `x` were added."""
  import numpy as np
  orders = {"".join(map(str, p)): ((x[p[0]] + x[p[1]]) + x[p[2]]) + x[p[3]]
            for p in itertools.permutations(range(4))}
  pairs = (x[0] + x[1]) + (x[2] + x[3])
  eighths = []
  for part in np.array_split(np.arange(y.size), 8):
    names = ["pairs"] * bool(np.array_equal(pairs[part], y[part])) + [
        k for k, v in orders.items() if np.array_equal(v[part], y[part])][:3]
    eighths.append(" ".join(names) or "other")
  return {"equal_device_order": float(np.mean(orders["0123"] == y)),
          "equal_pairs": float(np.mean(pairs == y)), "eighths": eighths}


def run_arm(arm: str, sizes: list[int]) -> dict:
  n = 2 if arm == "gloo_two_processes" else 1
  from mtp_jax import distributed  # not at the top: a worker sets JAX's variables first
  address = distributed.free_local_address()
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  procs = [subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), "--worker", arm, "--process_id", str(i),
       "--address", address, "--sizes", ",".join(map(str, sizes))],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(n)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, stderr) in zip(procs, outs):
    if p.returncode != 0:
      raise RuntimeError(f"{arm}: a worker exited {p.returncode}: {stderr[-2000:]}")
  return json.loads(outs[0][0].strip().splitlines()[-1])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="8,64,4096", help="elements per device, comma-separated")
  parser.add_argument("--json", default=None, help="also write the record here")
  parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
  parser.add_argument("--process_id", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--address", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  try:
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(s < 8 or s % 8 for s in sizes):
      raise ValueError
  except ValueError:
    parser.error(f"--sizes: comma-separated multiples of 8, got {args.sizes!r}")
  if args.worker:
    out = worker(args.worker, args.process_id, args.address, sizes)
    if args.process_id == 0:
      print(json.dumps(out))
    return 0
  arms = {arm: run_arm(arm, sizes) for arm in ARMS}
  keys = list(arms["in_process"])
  same = lambda a, b: [k for k in keys if arms[a][k]["sha256"] == arms[b][k]["sha256"]]
  record = {"experiment": "reduction_order", "sizes": sizes, "arms": arms,
            "gloo_one_equals_gloo_two": same("gloo_one_process", "gloo_two_processes"),
            "in_process_equals_gloo_two": same("in_process", "gloo_two_processes"),
            "collectives": keys}
  common.emit(record, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
