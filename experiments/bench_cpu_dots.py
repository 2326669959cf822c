"""GFLOP/s of the default train step's matmul shapes: XLA:CPU's dot (Eigen, as the CPU
defaults compile it, and YNNPACK) against PyTorch's torch.mm, one process, same inputs.

    python -m experiments.bench_cpu_dots --json experiments/results/bench_cpu_dots.json
    python -m experiments.bench_cpu_dots --cpus 0 --json ...   # one core: single-thread GEMM

Shapes (tokens 4096 = batch 16 x 256, d_model 256, d_ff 768, padded vocabulary 384): the MLP's
up and down projections, a weight gradient contracting the 4096 tokens, the attention
projections (one k/v projection of 128 and q|k|v fused to 512: model.fuse_projections) and the
logits. Each call is timed `--reps` times after a warm-up, libraries alternated call by call;
the median is reported. Tells whether a gap in the train step against PyTorch is its GEMMs
(compare `--cpus 0` and both cores: the libraries' single-thread speed and their threading).
"""

from __future__ import annotations

import argparse
import os
import time

from mtp_jax.backends.cpu import runtime

if __name__ == "__main__":  # before jax starts: XLA flags, malloc huge pages (README)
  runtime.apply_cpu_defaults()

import numpy as np

from experiments import common

SHAPES = [  # (name, [M, K] x [K, N], lhs transposed: a weight gradient x^T dy)
    ("mlp_up x[4096,256] @ W[256,768]", (4096, 256, 768), False),
    ("mlp_down h[4096,768] @ W[768,256]", (4096, 768, 256), False),
    ("weight_grad x^T[256,4096] @ dy[4096,768]", (256, 4096, 768), True),
    ("kv_proj x[4096,256] @ W[256,128]", (4096, 256, 128), False),
    ("qkv_fused x[4096,256] @ W[256,512]", (4096, 256, 512), False),
    ("logits h[4096,256] @ U[256,384]", (4096, 256, 384), False),
]
YNN_DOTS = {runtime.YNN_FUSION_OPTION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
SMOKE = {"reps": 2, "scale": 16}  # --smoke: the suite's run, every dimension / 16


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--json", default=None, help="write the records here")
  ap.add_argument("--reps", type=int, default=15, help="timed calls per library and shape")
  ap.add_argument("--cpus", default="", help="run on these CPUs only, e.g. 0 (as bench_train)")
  ap.add_argument("--scale", type=int, default=1, help="every dimension of every shape divided "
                  "by this (the names keep the full shapes; m_k_n is what ran)")
  common.add_flag_table(ap, [], SMOKE)
  args = ap.parse_args(argv)
  common.apply_smoke(ap, args, SMOKE)
  if args.scale < 1 or args.reps < 1:
    ap.error(f"--scale, --reps: positive integers, got {args.scale}, {args.reps}")
  try:
    cpus = common.parse_cpus(args.cpus)
  except ValueError as e:
    ap.error(str(e))
  if cpus:
    os.sched_setaffinity(0, cpus)
  import jax
  import torch
  torch.set_num_threads(len(os.sched_getaffinity(0)))

  records = []
  rng = np.random.default_rng(0)
  for name, mkn, transposed in SHAPES:
    M, K, N = (d // args.scale for d in mkn)
    a = rng.standard_normal((K, M) if transposed else (M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    ja, jb = jax.device_put(a), jax.device_put(b)
    f = (lambda x, y: x.T @ y) if transposed else (lambda x, y: x @ y)
    calls = {}
    for lib, opts in (("xla_eigen", {}), ("xla_ynnpack", YNN_DOTS)):
      exe = jax.jit(f).lower(ja, jb).compile(compiler_options=opts)
      calls[lib] = lambda exe=exe, x=ja, y=jb: exe(x, y).block_until_ready()
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    calls["torch_mm"] = lambda f=f, x=ta, y=tb: f(x, y)
    times = {lib: [] for lib in calls}
    for call in calls.values():
      call(), call()
    for _ in range(args.reps):  # alternated: the machine's noise hits every library alike
      for lib, call in calls.items():
        t = time.perf_counter()
        call()
        times[lib].append(time.perf_counter() - t)
    flops = 2 * M * K * N
    rec = {"shape": name, "m_k_n": [M, K, N], "lhs_transposed": transposed,
           "threads": len(os.sched_getaffinity(0)), "torch_version": torch.__version__,
           "jax_version": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    gflops = {lib: flops / float(np.median(t)) / 1e9 for lib, t in times.items()}
    for lib, g in gflops.items():  # 3 significant digits: a --smoke shape's figure is not 0.0
      rec[f"{lib}_gflops"] = float(f"{g:.3g}")
    rec["xla_eigen_over_torch"] = round(gflops["xla_eigen"] / gflops["torch_mm"], 3)
    records.append(rec)
    print(f"{name:44s} eigen {rec['xla_eigen_gflops']:6.1f}  ynnpack "
          f"{rec['xla_ynnpack_gflops']:6.1f}  torch {rec['torch_mm_gflops']:6.1f} GFLOP/s  "
          f"(eigen/torch {rec['xla_eigen_over_torch']:.2f})", flush=True)
  common.write_json(records, args.json)


if __name__ == "__main__":
  main()
