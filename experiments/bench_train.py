"""Train-step time of MTP against next-token prediction at matched parameters (paper Table S5).

    python -m experiments.bench_train --json out/bench_train.json [--config configs/default.py]
    python -m experiments.bench_train --peer --json experiments/results/bench_train_peer.json

For parallel heads with n_future in {1, 2, 4} (same n_layers, so the same parameter count) and
for sequential heads (n_future 4, extra depth modules), compiles the full train step (model,
per-head loss, gradients, AdamW) once, runs `--warmup` steps, then times `--steps` steps on one
random batch and reports the median. All variants run in this one process, interleaved round by
round, so machine noise hits them alike; quote the ratios, not the seconds.

`--peer` times the seed document's design in PyTorch (experiments/torch_peer.py: Llama trunk,
projection heads sharing one unembedding, its per-head loss, AdamW) against the same model in
mtp_jax (heads.kind = "projection") for n_future 1 and 4. Each (framework, n_future) is a worker
process (as a user runs either one) that builds its step and then waits; the driver asks them
for one step each, round after round, and reports tokens/s and the ratio, both of medians and as
the median same-round ratio. `--in_process` runs all four in this one process instead (PyTorch's
steps then slow the JAX steps down; docs/cpu_speed.md).

`--peer --ref_tree DIR` adds another checkout's JAX step (a worker started in DIR) and records
this code's speed over it as the median same-round ratio: a code change judged in one run.

`--ab "model.fuse_projections=off"` judges one change: the projection-heads train step with the
`--set` overrides and the same step with these on top, both compiled in this one process, their
`--burst` steps each in turn for `--steps` rounds (n_future 1 and 4; `--ab_kind`); reports
the base's speed over the variant's as the median same-round ratio and its quartiles. On a noisy
machine this is what tells a 5% change from noise; separate processes timed apart do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from mtp_jax.backends.cpu import runtime

if __name__ == "__main__":  # before jax starts: XLA flags, malloc huge pages (README)
  runtime.apply_cpu_defaults()

import jax
import numpy as np

from experiments import common
from mtp_jax.backends.cpu import gemm as cpu_gemm
from mtp_jax import steps as steps_lib
from mtp_jax.config import validation
from mtp_jax.config import load_file
from mtp_jax.model import param_count

REF = "jax@ref"  # --peer --ref_tree: the other checkout's JAX step
VARIANTS = [("parallel", 1), ("parallel", 2), ("parallel", 4), ("sequential", 4),
            ("projection", 4)]
# --smoke: the suite's run of every mode (configs/tiny.py's 3 layers grown to 5: 4 parallel heads
# need a trunk under them)
SMOKE = {"config": os.path.join(common.ROOT, "configs", "tiny.py"), "steps": 1, "warmup": 0,
         "burst": 1, "settle": 0.0, "variants": "parallel:1",
         "set": ["model.n_layers=5"]}


def setup(config_path, kind, n_future, overrides):
  c = load_file(config_path)
  c.model.heads.kind = kind
  c.model.n_future = n_future
  c.loss.head_weights = "deepseek" if kind == "sequential" else "uniform"
  common.apply_overrides(c, overrides)
  run, tokens, n_params, compile_s, box = _compiled(c)
  return {"step": box["training"].step, "state": box["state"], "batch": box["batch"],
          "compile_s": compile_s, "n_params": n_params, "tokens": tokens, "config": c}


def _compiled(c):
  """(run one step -> loss, tokens per step, n_params, first step seconds, the box holding the
  training, state and batch) of config `c` on one random batch of byte ids."""
  training = steps_lib.build_training(validation.resolve(c))  # a bad field: a named error
  batch = jax.device_put(common.random_batch(c, high=256))
  box = {"training": training, "state": training.init_state(0), "batch": batch}

  def run():
    box["state"], m = training.step(box["state"], batch)
    return float(jax.block_until_ready(m["loss"]))
  t = time.perf_counter()
  run()
  return (run, batch["tokens"].size, param_count(box["state"].params),
          time.perf_counter() - t, box)


def jax_run(c):
  """The compiled train step of config `c` on one random batch, compiled and run once."""
  return _compiled(c)[:4]


def _peer_config(args, overrides, n):
  c = load_file(args.config)
  c.model.heads.kind, c.model.n_future, c.loss.head_weights = "projection", n, "uniform"
  common.apply_overrides(c, overrides)
  return c


def _peer_step(args, overrides, fw, n):
  """(step, tokens, n_params, first_step_seconds) of framework `fw` ("jax" or "torch")."""
  c = _peer_config(args, overrides, n)
  if fw == "jax":
    return jax_run(c)
  from experiments import torch_peer
  t = time.perf_counter()
  step, tokens, n_params = torch_peer.make_peer(c)
  step()
  return step, tokens, n_params, time.perf_counter() - t


def peer_worker(args, overrides):
  """One (framework, n_future) in its own process: builds, runs a first step, then one timed
  step per "step" line on stdin, one JSON line per step on stdout."""
  fw, n = args.peer_worker.split(":")
  step, tokens, n_params, first_s = _peer_step(args, overrides, fw, int(n))
  info = {"tokens": tokens, "n_params": n_params, "first_step_seconds": first_s}
  if fw == "torch":
    import torch
    info.update(torch_threads=torch.get_num_threads(), torch_version=torch.__version__)
  print(json.dumps(info), flush=True)
  for line in sys.stdin:
    if not line.startswith("steps "):
      break
    print(json.dumps(_burst(step, int(line.split()[1]))), flush=True)


def _burst(step, k):
  """[(seconds, cpu_seconds)] of `k` back-to-back steps."""
  out = []
  for _ in range(k):
    t, cpu = time.perf_counter(), time.process_time()
    step()
    out.append((time.perf_counter() - t, time.process_time() - cpu))
  return out


def _peer_runs(args, overrides):
  """{(fw, n): (one_step() -> (seconds, cpu_seconds), info)}: a worker process each (default),
  or all four in this process (`--in_process`)."""
  runs, procs = {}, []
  for n in (1, 4):
    for fw in ("jax", "torch", *((REF,) if args.ref_tree else ())):
      if args.in_process:
        step, tokens, n_params, first_s = _peer_step(args, overrides, fw, n)

        def one(k, step=step):
          return _burst(step, k)
        info = {"tokens": tokens, "n_params": n_params, "first_step_seconds": first_s}
        if fw == "torch":
          import torch
          info.update(torch_threads=torch.get_num_threads(), torch_version=torch.__version__)
        runs[(fw, n)] = (one, info)
        continue
      cwd = args.ref_tree if fw == REF else None  # the other checkout's JAX step
      cmd, env = common.module_command("bench_train", tree=cwd)
      cmd += ["--config", args.config, "--peer_worker", f"{fw.split('@')[0]}:{n}", "--set",
              *args.set]
      p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env=env, cwd=cwd)
      procs.append(p)
      info = json.loads(p.stdout.readline())  # built one at a time: compiles do not overlap

      def one(k, p=p):
        p.stdin.write(f"steps {k}\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())
      runs[(fw, n)] = (one, info)
  return runs, procs


def peer(args, overrides):
  """JAX projection heads against the PyTorch seed design, n_future 1 and 4, interleaved step by
  step. By default every (framework, n_future) is its own process, as a user runs either: in one
  process the PyTorch steps slow the JAX steps after them down by 1.2-1.7x (docs/cpu_speed.md)."""
  runs, procs = _peer_runs(args, overrides)
  for _ in range(args.warmup):
    for one, _ in runs.values():
      one(1)
  # A round: each run in turn takes `--burst` back-to-back steps; the first one after the
  # others' turn is kept apart (JAX's first step after seconds idle is 1.3x slower, PyTorch's
  # is not: docs/cpu_speed.md); the round's time is the median of the rest, as in a training
  # loop. Rounds interleave the frameworks, so the machine's noise hits both alike.
  times = {v: [] for v in runs}
  cpu_times = {v: [] for v in runs}
  first_times = {v: [] for v in runs}
  for i in range(args.steps):  # each round starts one run later: no run always follows another
    for v in common.rotated(list(runs), i):
      time.sleep(args.settle)  # the previous run's threads (Eigen's, OpenMP's) stop spinning
      burst = runs[v][0](args.burst)
      first_times[v].append(burst[0][0])
      rest = burst[1:] or burst
      times[v].append(float(np.median([s for s, _ in rest])))
      cpu_times[v].append(float(np.median([c for _, c in rest])))
  for p in procs:
    p.stdin.close()
    p.wait()
  med = {v: float(np.median(t)) for v, t in times.items()}
  c = _peer_config(args, overrides, 1)
  records = []
  for n in (1, 4):
    j, t = runs[("jax", n)][1], runs[("torch", n)][1]
    rec = {"n_future": n, "kind": "projection", "config": args.config, "overrides": overrides,
           "processes": "one per framework" if not args.in_process else "one for all",
           "batch": c.train.batch_size, "seq_len": c.data.seq_len, "d_model": c.model.d_model,
           "n_layers": c.model.n_layers, "n_heads": c.model.n_heads,
           "n_kv_heads": c.model.n_kv_heads, "d_ff": c.model.d_ff, "dtype": c.model.dtype,
           "attention_impl": c.model.attention_impl, "remat_policy": c.model.remat_policy,
           # model.cpu_matmul, and why MKL's sgemm was not at hand (null: it was)
           "cpu_matmul": c.model.cpu_matmul, "cpu_gemm_unavailable": cpu_gemm.unavailable_reason(),
           "cpu_count": os.cpu_count(), "cpus": sorted(os.sched_getaffinity(0)),
           "load_avg_1min": os.getloadavg()[0],
           "torch_threads": t["torch_threads"], "torch_version": t["torch_version"],
           "jax_version": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
           "ld_preload": os.environ.get("LD_PRELOAD", ""), "rounds": args.steps,
           "burst": args.burst}
    for fw, info in (("jax", j), ("torch", t)):
      rec[f"{fw}_step_seconds_median"] = med[(fw, n)]
      rec[f"{fw}_tokens_per_sec"] = info["tokens"] / med[(fw, n)]
      rec[f"{fw}_n_params"] = info["n_params"]
      rec[f"{fw}_first_step_seconds"] = info["first_step_seconds"]
      rec[f"{fw}_step_seconds"] = times[(fw, n)]
      rec[f"{fw}_cpu_seconds"] = cpu_times[(fw, n)]
      rec[f"{fw}_first_of_burst_seconds"] = first_times[(fw, n)]
    rec["jax_over_torch_tokens_per_sec"] = med[("torch", n)] / med[("jax", n)]
    # Noise slows whole rounds down: the median over rounds of the same-round ratio.
    rec["jax_over_torch_same_round_median"] = float(np.median(
        np.asarray(times[("torch", n)]) / np.asarray(times[("jax", n)])))
    if args.ref_tree:  # this code's step over the other checkout's, round by round
      median, quartiles = common.same_round(times[(REF, n)], times[("jax", n)])
      rec.update(ref_tree=os.path.abspath(args.ref_tree), ref_step_seconds=times[(REF, n)],
                 jax_over_ref_same_round_median=median, jax_over_ref_quartiles=quartiles)
    records.append(rec)
  print("| n_future | params jax / torch | jax tokens/s | torch tokens/s | jax / torch "
        "| same-round median |")
  print("|---|---|---|---|---|---|")
  for r in records:
    print(f"| {r['n_future']} | {r['jax_n_params']:,} / {r['torch_n_params']:,} | "
          f"{r['jax_tokens_per_sec']:,.0f} | {r['torch_tokens_per_sec']:,.0f} | "
          f"{r['jax_over_torch_tokens_per_sec']:.2f}x | "
          f"{r['jax_over_torch_same_round_median']:.2f}x |")
    if args.ref_tree:
      print(f"  n_future {r['n_future']}: this code / {args.ref_tree} "
            f"{r['jax_over_ref_same_round_median']:.3f}x (quartiles "
            f"{r['jax_over_ref_quartiles'][0]:.3f}-{r['jax_over_ref_quartiles'][1]:.3f})")
  return records


def _stepping(run):
  """A no-argument step of a `setup` record (its state carried in the record): for `_burst`."""
  def step():
    run["state"], m = run["step"](run["state"], run["batch"])
    jax.block_until_ready(m)
  return step


def ab(args, overrides, extra):
  """Base (`--set`) against base + `extra` (`--ab`) overrides, in this process, alternated."""
  records = []
  for n in (1, 4):
    steps = [_stepping(setup(args.config, args.ab_kind, n, o))
             for o in (overrides, {**overrides, **extra})]
    for step in steps:
      _burst(step, max(args.warmup, 1))
    times = [[], []]
    for _ in range(args.steps):  # a round: each takes --burst steps back to back, as in training
      for step, t in zip(steps, times):
        burst = [s for s, _ in _burst(step, max(args.burst, 1))]
        t.append(float(np.median(burst[1:] or burst)))  # the first after the other's turn apart
    ratio = np.asarray(times[1]) / np.asarray(times[0])  # > 1: the base is faster
    rec = {"kind": args.ab_kind, "n_future": n, "base_overrides": overrides, "ab": extra,
           "rounds": args.steps, "burst": args.burst, "base_step_seconds": times[0],
           "ab_step_seconds": times[1],
           "base_over_ab_speed_same_round_median": float(np.median(ratio)),
           "quartiles": [float(np.percentile(ratio, 25)), float(np.percentile(ratio, 75))],
           "cpus": sorted(os.sched_getaffinity(0)), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}
    records.append(rec)
    speed, (q1, q3) = rec["base_over_ab_speed_same_round_median"], rec["quartiles"]
    print(f"n_future {n}: base {np.median(times[0]):.3f} s, with {args.ab} "
          f"{np.median(times[1]):.3f} s; base / variant speed {speed:.3f}x "
          f"(quartiles {q1:.3f}-{q3:.3f})", flush=True)
  return records


def _parse_variants(text: str) -> list[tuple[str, int]]:
  """--variants "parallel:1,projection:4" -> [(kind, n_future)]; ValueError names the flag."""
  out = []
  for item in text.split(","):
    kind, _, n = item.partition(":")
    if not n.isdigit() or int(n) < 1:
      raise ValueError(f"--variants: a list like parallel:1,sequential:4, got {text!r}")
    out.append((kind, int(n)))
  if ("parallel", 1) not in out:
    raise ValueError(f"--variants: parallel:1 (the base of ratio_to_ntp) must be one, got {text!r}")
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="configs/default.py")
  ap.add_argument("--json", default=None, help="write the records here")
  ap.add_argument("--steps", type=int, default=5, help="timed steps per variant")
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--set", nargs="*", action="extend", default=[],
                  help="overrides like train.batch_size=8 (repeatable)")
  ap.add_argument("--peer", action="store_true",
                  help="time the PyTorch seed design against mtp_jax, n_future 1 and 4")
  ap.add_argument("--burst", type=int, default=3,
                  help="back-to-back steps per variant and round; the first (after idling) is "
                  "set apart (1: one step per round, the old protocol)")
  ap.add_argument("--settle", type=float, default=0.3,
                  help="--peer: seconds idle before each run's burst")
  ap.add_argument("--in_process", action="store_true",
                  help="--peer: both frameworks in this one process (slows JAX; see README)")
  ap.add_argument("--cpus", default="",
                  help="run on these CPUs only, e.g. 0 or 0-1 (os.sched_setaffinity, inherited by "
                  "the --peer workers; PyTorch and XLA size their thread pools to it): one core "
                  "compares the frameworks' single-thread work, all of them adds their threading")
  ap.add_argument("--ab", default="",
                  help="overrides like model.fuse_projections=off (comma-separated): time the "
                  "step with and without them in this process, steps alternated")
  ap.add_argument("--ab_kind", default="projection", help="--ab: the head kind")
  ap.add_argument("--ref_tree", default=None,
                  help="--peer: also time another checkout's JAX step (a worker run from that "
                  "folder) and record this code's speed over it, round by round")
  ap.add_argument("--variants", default=",".join(f"{k}:{n}" for k, n in VARIANTS),
                  help="the default mode's kind:n_future list (parallel:1 among them: the base "
                  "of ratio_to_ntp)")
  ap.add_argument("--peer_worker", default=None, help=argparse.SUPPRESS)
  common.add_flag_table(ap, [], SMOKE)
  args = ap.parse_args(argv)
  common.apply_smoke(ap, args, SMOKE)
  try:  # bad input fails here, before any compile
    variants = _parse_variants(args.variants)
    overrides = common.parse_overrides(args.set)
    common.apply_overrides(load_file(args.config), overrides)
    cpus = common.parse_cpus(args.cpus)
    if args.ref_tree and (args.in_process or not args.peer
                          or not common.is_checkout(args.ref_tree, "bench_train")):
      raise ValueError(f"--ref_tree: needs --peer (not --in_process) and a checkout of this "
                       f"repository, got {args.ref_tree!r}")
    extra = {}
    if args.ab:
      try:
        extra = common.parse_overrides(args.ab.split(","))
      except ValueError as e:
        raise ValueError(str(e).replace("--set:", "--ab:", 1)) from None
      c = load_file(args.config)
      common.apply_overrides(c, {**overrides, **extra})
      validation.validate(c)
  except ValueError as e:
    ap.error(str(e))
  if cpus:
    os.sched_setaffinity(0, cpus)
  if args.peer_worker:
    return peer_worker(args, overrides)
  if args.ab:
    common.write_json(ab(args, overrides, extra), args.json)
    return
  if args.peer:
    records = peer(args, overrides)
    common.write_json(records, args.json)
    return
  runs = {v: setup(args.config, *v, overrides) for v in variants}
  steps = {v: _stepping(r) for v, r in runs.items()}
  for _ in range(args.warmup):
    for step in steps.values():
      step()
  times = {v: [] for v in variants}
  for _ in range(args.steps):  # interleaved: noise hits every variant alike
    for v, step in steps.items():
      # back to back; the first after idling kept out
      burst = [s for s, _ in _burst(step, max(args.burst, 1))]
      times[v].append(float(np.median(burst[1:] or burst)))
  base = float(np.median(times[("parallel", 1)]))
  records = []
  for (kind, n), r in runs.items():
    med = float(np.median(times[(kind, n)]))
    records.append({"kind": kind, "n_future": n, "step_seconds_median": med, "burst": args.burst,
                    "ratio_to_ntp": med / base, "n_params": r["n_params"],
                    "tokens_per_sec": r["tokens"] / med, "compile_seconds": r["compile_s"],
                    "batch": r["config"].train.batch_size, "seq_len": r["config"].data.seq_len,
                    "d_model": r["config"].model.d_model, "n_layers": r["config"].model.n_layers,
                    "backend": jax.devices()[0].platform})
  print("| kind | n_future | params | step s (median) | ratio to n=1 | tokens/s |")
  print("|---|---|---|---|---|---|")
  for rec in records:
    print(f"| {rec['kind']} | {rec['n_future']} | {rec['n_params']:,} | "
          f"{rec['step_seconds_median']:.3f} | {rec['ratio_to_ntp']:.3f} | "
          f"{rec['tokens_per_sec']:,.0f} |")
  common.write_json(records, args.json)


if __name__ == "__main__":
  main()
