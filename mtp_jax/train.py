"""The training loop and its command line:

    python -m mtp_jax.train --config configs/default.py --workdir DIR [--config.train.steps=N]

Data, resume, progress, eval, checkpoints, signals, summary; the state and the jitted steps it
drives are in steps.py, what it reports goes through metrics.MetricsWriter. Rerunning the same
command resumes from the latest good checkpoint in DIR/checkpoints with the data iterator where
it was, so an interrupted run ends with the same params as an uninterrupted one (`params_sha256`
in DIR/summary.json). Exit status: 0 done, 2 bad input (one line on stderr), 3 non-finite
training stopped, 4 checkpoint failure; with several processes, 5 not every process arrived at
start-up and 6 a peer process lost during the run (each one line on stderr).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import json
import os
import signal
import sys
import time

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from mtp_jax import acceptance, cli, distributed
from mtp_jax import flops as flops_lib
from mtp_jax import loss as loss_lib
from mtp_jax import sharding as shard_lib
from mtp_jax import steps as steps_lib
from mtp_jax import workdir as workdir_lib
from mtp_jax.checkpoint import Checkpointer
from mtp_jax.config import validation
from mtp_jax.data import pipeline, tokenizers
from mtp_jax.data import rows as rows_lib
from mtp_jax.metrics import MetricsWriter, machine, write_summary
from mtp_jax.model import param_count


class NonFiniteError(RuntimeError):
  pass


class _StopFlag:
  """SIGTERM / SIGINT set a flag; the loop saves and exits at the next step boundary.

  With several processes a signal reaches each at its own step, and all must save the same one:
  there JAX's preemption sync manager (started by jax.distributed, SIGTERM) picks the step every
  process stops at (`stop_at_step`); this class leaves the signals alone there (Ctrl-C ends a
  process as Python does, and JAX then ends its peers)."""

  def __init__(self):
    self.signum = None
    self._old = {}
    self._multi = jax.process_count() > 1
    self._calls = 0  # JAX's sync counter: this process's steps, from 1 whatever the start step

  def __enter__(self):
    for s in () if self._multi else (signal.SIGTERM, signal.SIGINT):
      self._old[s] = signal.signal(s, self._set)
    return self

  def _set(self, signum, _frame):
    self.signum = signum

  def stop_at_step(self, step: int) -> bool:
    """Whether to save and stop after `step`; every process of a run gets the same answer."""
    if self._multi:
      from jax.experimental import multihost_utils
      self._calls += 1  # not `step`: a notice before the first call stops at count 1
      if multihost_utils.reached_preemption_sync_point(self._calls):
        self.signum = signal.SIGTERM
    return self.signum is not None

  def __exit__(self, *exc):
    for s, old in self._old.items():
      signal.signal(s, old)


def check_inputs(config: ml_collections.ConfigDict, workdir: str | None
                 ) -> ml_collections.ConfigDict:
  """Everything that can be wrong with the command line, before anything is written; returns
  the config resolved (checked, presets expanded: what the run saves in config.json)."""
  if config is None:
    raise ValueError("--config: required, e.g. --config configs/default.py")
  if not workdir:
    raise ValueError("--workdir: required, the folder for checkpoints and metrics")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir: {workdir!r} exists and is not a folder")
  validation.resolve(config)  # the one check of the run's config
  if config.train.init_from:
    workdir_lib.check_init_from(config, config.train.init_from)
  tok = tokenizers.get_tokenizer(config.data)
  if tok.vocab_size > config.model.vocab_size:
    raise ValueError(f"config.model.vocab_size: the {config.data.tokenizer} tokenizer has "
                     f"{tok.vocab_size} ids, so it must be >= {tok.vocab_size}, got "
                     f"{config.model.vocab_size}")
  return config


def validation_metrics(eval_step, params, config, batch_sharding,
                       batches: int | None = None) -> dict:
  """Per-head loss / accuracy / agreement / acceptance (alpha_k, greedy and sampled) over the
  first `batches` (default `train.eval_batches`) validation batches (the same ones every time):
  their sums added, then divided once (`loss.summarise`), so ratios weigh every token alike.
  `batch_sharding` None: one process's default device."""
  it = pipeline.make_iterator(config, "validation", repeat=False)
  sums = None
  for _, batch in zip(range(config.train.eval_batches if batches is None else batches), it):
    part = jax.device_get(eval_step(params, shard_lib.shard_batch(batch, batch_sharding)))
    sums = part if sums is None else jax.tree.map(np.add, sums, part)
  if sums is None:
    logging.warning("validation split is empty: no eval")
    return {}
  _, m = loss_lib.summarise(sums, loss_lib.head_weights(config), config.loss.z_loss)
  out = {k: np.asarray(m[k]) for k in ("head_loss", "head_acc", "head_agree", "head_alpha_greedy",
                                        "head_alpha_sampled", "head_tokens") if k in m}
  acc = acceptance.from_metrics(out)
  out.update({k: v for k, v in acc.items() if k.startswith(acceptance.ESTIMATE)})
  return out


def _per_process(n: int) -> list[int]:
  """Every process's `n`, in process order (a collective: every process calls it)."""
  if jax.process_count() == 1:
    return [n]
  from jax.experimental import multihost_utils
  parts = np.asarray(multihost_utils.process_allgather(  # int32 halves: jax without x64
      np.array([n >> 31, n & (2**31 - 1)], np.int32))).reshape(-1, 2).astype(np.int64)
  return [int(hi << 31 | lo) for hi, lo in parts]


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs (or resumes) training to config.train.steps; returns the summary it writes. Checks
  its inputs first (`check_inputs`)."""
  t_start = time.time()
  check_inputs(config, workdir)
  distributed.maybe_initialize_distributed(config.mesh)  # before anything touches a device
  # Process 0 alone writes the run's files and prints; every process writes its own rows' log.
  process, n_processes = jax.process_index(), jax.process_count()
  primary = process == 0
  # Process 0 builds the data set where it is missing (a corpus's tfds build) before the others
  # open it: several builders of one folder collide. Hosts with their own disks each build.
  timeout = config.mesh.distributed_timeout_s  # bounds every barrier (distributed.py)
  building = "process 0 builds a missing data set first: prepare it beforehand if that is slow"
  if not primary:
    distributed.sync_processes("mtp_jax_train_data_built", timeout, building)
  train_it = pipeline.make_iterator(config, "train")
  next(iter(pipeline.make_iterator(config, "validation", repeat=False)))  # fail now, not at eval
  if primary:
    distributed.sync_processes("mtp_jax_train_data_built", timeout, building)
  workdir_lib.check_resume(config, workdir)
  os.makedirs(workdir, exist_ok=True)
  # All have read config.json before it changes.
  distributed.sync_processes("mtp_jax_train_checked", timeout, "opening the data")
  if primary:
    workdir_lib.write_config(config, workdir)

  mesh = shard_lib.make_mesh(config)
  shard_lib.check_batch(config, mesh)
  training = steps_lib.build_training(config, mesh)
  model, batch_sh, train_step = training.model, training.batch_sharding, training.step
  # This process's rows of each batch; token shards read only those (data/rows.py), other
  # corpora pack the whole global batch in every process and hand the devices their rows.
  rows = shard_lib.local_rows(config.train.batch_size, batch_sh)
  ckpt = Checkpointer(workdir_lib.checkpoints_dir(workdir), keep=config.train.keep_checkpoints,
                      async_save=config.train.async_checkpoints, timeout_s=timeout)
  try:  # a bad resume closes orbax's manager: its background clean-up of temporary folders
    # must not outlive the interpreter (a traceback after the one-line error)
    packs_all = rows_lib.unsupported_on_resume(config.data, ckpt.saved_data_state())
    if not packs_all:
      train_it = rows_lib.make_local_iterator(config, rows)
    elif n_processes > 1 and primary:
      print(f"warning: every process packs the whole global batch ({packs_all}); prepare the "
            "corpus once with `python -m mtp_jax.data.prepare` to read only each process's rows",
            file=sys.stderr, flush=True)
    whole = bool(packs_all) or rows == [(0, config.train.batch_size)]  # the batch is all here
    put = (lambda b: shard_lib.shard_batch(b, batch_sh)) if whole else (
        lambda b: rows_lib.put_local_rows(b, batch_sh, rows, config.train.batch_size))
    restored = ckpt.restore_latest(training.abstract_state(), train_it)
    if restored is None and config.train.init_from:  # a new run from imported or trained params
      state = workdir_lib.init_state_from(model, training.tx, config, mesh, config.train.init_from)
    elif restored is None:
      state = training.init_state(config.seed)
    else:
      state = restored[0]
  except BaseException:
    ckpt.close()
    raise
  start, steps = int(state.step), config.train.steps
  end = min(config.train.stop_at or steps, steps)
  n_params = param_count(state.params)
  how = "resuming at" if restored else "starting" + (
      f" from {config.train.init_from}" if config.train.init_from else "")
  say = (lambda line: print(line, flush=True)) if primary else (lambda line: None)
  say(f"{how} step {start}/{steps}: "
      f"{n_params:,} params, {config.model.heads.kind} heads, n_future "
      f"{config.model.n_future}, {len(jax.devices())} {jax.devices()[0].platform} device(s)"
      + (f" in {n_processes} processes" if n_processes > 1 else ""))

  eval_step = jax.jit(steps_lib.make_eval_step(model, config))
  tokens_per_step = config.train.batch_size * config.data.seq_len
  try:
    flops_per_token = flops_lib.flops_per_token(config)["total"]
  except ValueError as e:  # a head kind without HeadKind.flops_per_token: train on, without MFU
    logging.warning("no MFU: %s", e)
    flops_per_token = None
  peak_flops, peak_source = flops_lib.peak_flops_per_device(config.model.dtype)
  mfu_of = lambda tps: (flops_lib.mfu(tps, flops_per_token, peak_flops, jax.device_count())
                        if flops_per_token else None)
  writer = MetricsWriter(workdir, total_steps=steps, tokens_per_step=tokens_per_step,
                         mfu=mfu_of, primary=primary)
  batches_f = open(workdir_lib.batches_path(workdir), "a") if primary and whole else None
  rows_f = (open(workdir_lib.process_batches_path(workdir, process, n_processes), "a")
            if n_processes > 1 else None)
  pending, tokens_read = None, 0
  t_log, step_log, t_first = time.time(), start, None

  def handle(step, metrics):
    nonlocal t_log, step_log
    m = jax.device_get(metrics)
    if int(m["nonfinite_consecutive"]) >= config.optim.max_consecutive_nonfinite:
      raise NonFiniteError(
          f"{int(m['nonfinite_consecutive'])} consecutive non-finite steps at step {step} "
          f"(optim.max_consecutive_nonfinite = {config.optim.max_consecutive_nonfinite}); "
          f"stopped, the last good checkpoint in {ckpt.directory} is kept")
    if step % config.train.log_every == 0 or step == end:
      now = time.time()
      tps = (step - step_log) * tokens_per_step / max(now - t_log, 1e-9)
      m["tokens_per_sec"] = tps
      writer.write(step, "train", m)
      t_log, step_log = now, step

  try:
    with _StopFlag() as stop, shard_lib.activation_rules(mesh, config):
      for step in range(start, end):
        batch = next(train_it)  # the global batch (`whole`), or this process's rows of it
        tokens_read += int(np.count_nonzero(batch["segment_ids"]))
        if batches_f:
          batches_f.write(f"{step} {steps_lib.batches_sha256([batch])}\n")
        if rows_f:
          mine = batch if not whole else {
              k: np.concatenate([v[a:b] for a, b in rows]) for k, v in batch.items()}
          rows_f.write(f"{step} {steps_lib.batches_sha256([mine])} rows "
                       + ",".join(f"{a}:{b}" for a, b in rows) + "\n")
        state, metrics = train_step(state, put(batch))
        if pending is not None:
          handle(*pending)  # metrics read one step late: no host sync on the step just issued
        pending = (step + 1, metrics)
        if t_first is None:
          t_first = time.time()  # excludes the first step's compile from tokens/s
        done = step + 1
        if done % config.train.eval_every == 0 or done == end:
          ev = validation_metrics(eval_step, state.params, config, batch_sh)
          if ev:
            writer.write(done, "eval", ev)
        stopping = stop.stop_at_step(done)
        if done % config.train.checkpoint_every == 0 or done == end or stopping:
          ckpt.save(done, state, train_it, force=True)
        if stopping:
          handle(*pending)
          pending = None
          ckpt.wait()
          say(f"signal {stop.signum}: saved step {done}, exiting")
          break
      if pending is not None:
        handle(*pending)
    ckpt.wait()
  finally:  # an error still commits the saves in flight and flushes the logs
    ckpt.close()
    for f in (batches_f, rows_f):
      if f:
        f.close()
    writer.close()

  step = int(state.step)
  run_steps = max(step - start - 1, 0)
  run_secs = time.time() - t_first if t_first else 0.0
  tokens_per_sec = run_steps * tokens_per_step / run_secs if run_steps and run_secs else 0.0
  summary = {
      "step": step,
      "steps": steps,
      "n_params": n_params,
      "tokens_seen": step * tokens_per_step,
      "tokens_per_sec": tokens_per_sec,
      "flops_per_token": flops_per_token,  # model FLOPs of a train step (flops.py), per token
      "mfu": mfu_of(tokens_per_sec) if tokens_per_sec else None,
      "peak_flops_per_device": peak_flops,
      "peak_flops_source": peak_source,
      "wall_seconds": time.time() - t_start,
      **machine(),  # where the timings come from (process 0's host)
      "processes": n_processes,
      "devices": jax.device_count(),
      "params_sha256": steps_lib.params_sha256(state.params),
      # The tokens of the train rows each process read from the corpus in this run: 1/P of the
      # batches' where it reads its own rows (`reads_own_rows`), all of them where it packs.
      "tokens_read_per_process": _per_process(tokens_read),
      "reads_own_rows": not packs_all,
      "head_kind": config.model.heads.kind,
      "n_future": config.model.n_future,
      "interrupted": bool(stop.signum),
      **writer.last["train"],
      **writer.last["eval"],
  }
  trained = step > start
  if primary and trained:  # alpha_k over the run's evals, where there are two or more
    acceptance.plot_run(workdir, min_evals=2)
  if not trained:
    say(f"nothing to train: already at step {step} (this run ends at {end}); summary.json "
        "keeps the figures of the steps that were trained")
  if not primary:
    return summary
  return write_summary(workdir_lib.summary_path(workdir), summary, trained=trained)


def cli_main(flags_) -> int:
  """Exit status: 0 done, 2 bad input (one line on stderr), 3 non-finite training stopped,
  4 checkpoint failure, 5 not every process arrived (distributed.py), 6 a peer process lost."""
  try:
    summary = train(flags_.config, flags_.workdir)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except NonFiniteError as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  except RuntimeError as e:  # a peer gone, or a checkpoint that cannot be saved or restored
    peer = distributed.lost_peer(e)
    if peer:
      print(f"error: lost a peer process: {peer}", file=sys.stderr)
      return distributed.EXIT_PEER_LOST
    print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
    return 4
  if jax.process_index() == 0:
    print(json.dumps({k: summary[k] for k in ("step", "params_sha256", "tokens_per_sec")}))
  return 0


def main(argv):
  del argv
  cli.quiet_logs()
  status = cli_main(cli.FLAGS)
  if status == distributed.EXIT_PEER_LOST:
    # Not through the interpreter's exit: JAX's shutdown there waits at a barrier for the lost
    # peer and then aborts the process (SIGABRT), which would replace this status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  sys.exit(status)


if __name__ == "__main__":
  # Defined here, not at import: `from mtp_jax import train` (a notebook, generate's flags in the
  # same process) must not define --workdir a second time.
  config_flags.DEFINE_config_file("config", None, "ml_collections config file", lock_config=True)
  flags.DEFINE_string("workdir", None, "where checkpoints, metrics and summary.json go")
  app.run(main, flags_parser=cli.parse_flags)
