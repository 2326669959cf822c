"""Compiled memory of the MTP loss and of a train step, against the number of heads.

    python experiments/bench_memory.py --json memory.json [--png memory.png]

`jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes` is what XLA's buffer
assignment reserves for intermediates: exact, no noise, available on CPU, and nothing is
allocated (every input is a `jax.ShapeDtypeStruct`, params come from `jax.eval_shape`). Two
programs, each `jax.value_and_grad`:

- loss: `mtp_loss` (scan over heads, checkpointed body, optional token tiles) or
  `naive_mtp_loss` (all heads' logits at once) on h_NxBxSxD and the unembedding, gradients
  w.r.t. both;
- train_step: model forward + loss, gradients w.r.t. every parameter (no optimizer update), for a
  parallel-heads model whose n_layers stays fixed (matched parameters, Gloeckle et al. §3).

Gloeckle et al. 2024 §2 claim O(V + d) logit memory for the per-head loss instead of O(nV + d);
this measures it. Prints a markdown table and writes a JSON list of records.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from mtp_jax import config as config_lib
from mtp_jax.config import validation
from mtp_jax.loss import model_loss, mtp_loss, naive_mtp_loss
from mtp_jax.model import build_model, init_params, param_count

N_FUTURE = (1, 2, 4, 8)
VARIANTS = (("scan", 1), ("scan", 4), ("naive", 1))  # (impl, token_chunks)
LOSS = dict(vocab_size=32768, d_model=256, batch=8, seq_len=256, dtype="float32")
MODEL = dict(head_kind="parallel", vocab_size=32768, d_model=256, n_layers=8, n_heads=8,
             n_kv_heads=4, d_ff=768, batch=8, seq_len=256, tie_embeddings=True,
             remat_policy="none", scan_layers=True, dtype="float32")


def _analysis(f, *args) -> dict:
  t0 = time.perf_counter()
  compiled = jax.jit(f).lower(*args).compile()
  return {**common.memory_record(compiled), "compile_s": round(time.perf_counter() - t0, 2)}


def loss_record(n: int, impl: str, chunks: int) -> dict:
  V, D, B, S = LOSS["vocab_size"], LOSS["d_model"], LOSS["batch"], LOSS["seq_len"]
  weights = np.ones(n, np.float32)
  if impl == "naive":
    loss = lambda h, w, t: naive_mtp_loss(h, w, t, None, weights)[0]
  else:
    loss = lambda h, w, t: mtp_loss(h, w, t, None, weights, token_chunks=chunks)[0]
  rec = _analysis(jax.value_and_grad(loss, argnums=(0, 1)),
                  jax.ShapeDtypeStruct((n, B, S, D), jnp.float32),
                  jax.ShapeDtypeStruct((D, V), jnp.float32),
                  jax.ShapeDtypeStruct((B, S), jnp.int32))
  return {"what": "loss", "impl": impl, "n_future": n, "token_chunks": chunks, **rec,
          "one_head_logits_bytes": B * S * V * 4}


def model_config(n: int, chunks: int):
  c = config_lib.base_config()
  m = c.model
  m.heads.kind = MODEL["head_kind"]
  m.vocab_size, m.d_model, m.n_layers = MODEL["vocab_size"], MODEL["d_model"], MODEL["n_layers"]
  m.n_heads, m.n_kv_heads, m.d_ff = MODEL["n_heads"], MODEL["n_kv_heads"], MODEL["d_ff"]
  m.tie_embeddings, m.remat_policy = MODEL["tie_embeddings"], MODEL["remat_policy"]
  m.scan_layers, m.dtype = MODEL["scan_layers"], MODEL["dtype"]
  m.max_len = c.data.seq_len = MODEL["seq_len"]
  m.n_future = n
  c.train.batch_size = MODEL["batch"]
  c.loss.token_chunks = chunks
  return validation.validate(c)


def train_step_record(n: int, impl: str, chunks: int) -> dict:
  c = model_config(n, chunks)
  model = build_model(c)
  params = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
  step = jax.value_and_grad(
      lambda p, t: model_loss(p, model, c, {"tokens": t}, naive=impl == "naive")[0])
  rec = _analysis(step, params,
                  jax.ShapeDtypeStruct((MODEL["batch"], MODEL["seq_len"]), jnp.int32))
  return {"what": "train_step", "impl": impl, "n_future": n, "token_chunks": chunks, **rec,
          "params": param_count(params), "trunk_blocks": model.args.n_trunk}


def _record(job) -> dict:
  what, n, impl, chunks = job
  return (loss_record if what == "loss" else train_step_record)(n, impl, chunks)


def header() -> str:
  L, M = LOSS, MODEL
  return (f"Compiled temp memory (MB = 1e6 bytes) of jax.value_and_grad, "
          f"jax {jax.__version__}, {jax.default_backend()} backend. "
          f"loss: V={L['vocab_size']}, d={L['d_model']}, B x S = {L['batch']} x {L['seq_len']}, "
          f"{L['dtype']}, grads w.r.t. h and the unembedding. "
          f"train_step: {M['head_kind']} heads, d_model {M['d_model']}, n_layers "
          f"{M['n_layers']} (trunk n_layers - n_future), {M['n_heads']}/{M['n_kv_heads']} "
          f"attention/kv heads, d_ff {M['d_ff']}, vocab {M['vocab_size']}, batch "
          f"{M['batch']} x {M['seq_len']}, remat {M['remat_policy']}, {M['dtype']}, grads "
          "w.r.t. all params (no optimizer update).")


def table(records) -> str:
  lines = [header(), "",
           "| what | impl | token_chunks | " + " | ".join(f"n={n}" for n in N_FUTURE)
           + " | n=8 / n=1 |",
           "|---|---|---|" + "---:|" * (len(N_FUTURE) + 1)]
  for what in ("loss", "train_step"):
    for impl, chunks in VARIANTS:
      mb = {r["n_future"]: r["temp_bytes"] / 1e6 for r in records
            if (r["what"], r["impl"], r["token_chunks"]) == (what, impl, chunks)}
      lines.append(f"| {what} | {impl} | {chunks} | "
                   + " | ".join(f"{mb[n]:,.0f}" for n in N_FUTURE)
                   + f" | {mb[N_FUTURE[-1]] / mb[N_FUTURE[0]]:.2f} |")
  return "\n".join(lines)


def plot(records, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for ax, what in zip(axes, ("loss", "train_step")):
    for impl, chunks in VARIANTS:
      rs = sorted((r for r in records
                   if (r["what"], r["impl"], r["token_chunks"]) == (what, impl, chunks)),
                  key=lambda r: r["n_future"])
      ax.plot([r["n_future"] for r in rs], [r["temp_bytes"] / 1e6 for r in rs], marker="o",
              linestyle="--" if impl == "naive" else "-", label=f"{impl}, token_chunks={chunks}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(N_FUTURE, [str(n) for n in N_FUTURE])
    ax.set_xlabel("n_future (heads)")
    ax.set_ylabel("compiled temp memory (MB)")
    ax.set_title(f"{what}: value_and_grad")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(f"loss: V={LOSS['vocab_size']}, d={LOSS['d_model']}, {LOSS['batch']}x"
               f"{LOSS['seq_len']} tokens; train_step: parallel, d_model {MODEL['d_model']}, "
               f"{MODEL['n_layers']} layers", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", required=True, help="where to write the records")
  parser.add_argument("--png", default=None, help="optional plot of temp memory against n")
  parser.add_argument("--workers", type=int, default=2, help="processes compiling at once")
  parser.add_argument("--tiny", action="store_true",
                      help="n_future 1 and 2, V 512, d 32, 2 layers, 2 x 32 tokens, one process "
                      "(the suite's smoke run)")
  args = parser.parse_args(argv)
  if args.tiny:  # module globals: read by the records and the table (spawned workers would not)
    global N_FUTURE
    N_FUTURE, args.workers = (1, 2), 1
    LOSS.update(vocab_size=512, d_model=32, batch=2, seq_len=32)
    MODEL.update(vocab_size=512, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64,
                 batch=2, seq_len=32)

  t0 = time.perf_counter()
  jobs = [(what, n, impl, chunks) for what in ("loss", "train_step")
          for impl, chunks in VARIANTS for n in N_FUTURE]
  if args.workers > 1:
    # One compile at a time per process (threads do not overlap), so use processes; spawned,
    # never forked, since this process has already started JAX.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
      records = list(pool.map(_record, jobs))
  else:
    records = [_record(job) for job in jobs]
  shared = {"jax": jax.__version__, "backend": jax.default_backend()}
  for r in records:
    r["config"] = {**(LOSS if r["what"] == "loss" else MODEL), **shared}
  with open(args.json, "w") as f:
    json.dump(common.stamp(records), f, indent=1)
  print(table(records))
  if args.png:
    plot(records, args.png)
  print(f"\n{len(records)} programs compiled in {time.perf_counter() - t0:.0f} s; "
        f"records in {args.json}" + (f", plot in {args.png}" if args.png else ""))


if __name__ == "__main__":
  main()
