"""Checkpoints: the train state and the data-iterator state, saved by orbax, restored with checks.

One `orbax.checkpoint.CheckpointManager` over `<workdir>/checkpoints`, one folder per step:

  <checkpoints>/<step>/state/...            the state pytree (orbax StandardSave, OCDBT)
  <checkpoints>/<step>/data_iter/process_<i>-of-<n>.json
                                            grain's own orbax handler, a file per process; the
                                            states are all the same (every process iterates the
                                            global batch), so a step restores on any process
                                            count (`_AnyProcessCountHandler`)
  <checkpoints>/corrupt-<step>-<n>/         a step that failed to restore, moved aside (never
                                            deleted: a person may still want to look at it)

Why the checks. Measured with orbax-checkpoint 0.12.8 (docs/DESIGN.md, "Traps found so far"):
- An empty or partial step folder is still listed as the latest step, and a restore without
  arguments returns `{}` with no error. So `restore_latest` reads the step's metadata, restores
  into the caller's tree, checks structure, shapes, dtypes and the iterator state, and on any
  failure moves the step aside and tries the one before.
- A step whose metadata is readable but describes another tree (another model size, another
  optimizer) is not corrupt: it is the wrong run. That raises `ValueError` at once and moves
  nothing, so a config change cannot shunt every checkpoint of a run aside.
- Old steps are garbage-collected by orbax (`max_to_keep`) in its save-finalize thread, after the
  new step's background commit has been joined and checked; a failed commit raises before that
  deletion, so the last good step survives it (tests/test_checkpoint.py injects that failure).
- Orbax's save captures arrays to host before it returns and grain's handler is synchronous, so
  the train loop may donate the state and advance the iterator right after `save` returns.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from typing import Any

from etils import epath
import grain.checkpoint as grain_checkpoint
import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

STATE = "state"
DATA_ITER = "data_iter"
CORRUPT_PREFIX = "corrupt-"


class _Corrupt(Exception):
  """A step folder that cannot give back what was saved; the message says why."""


class _AnyProcessCountHandler(grain_checkpoint.CheckpointHandler):
  """grain's handler, restoring on any process count. grain reads the file of this process's
  index and count, which a step saved by another number of processes lacks; the pipeline's
  iterator state is the same in every process, so process 0's file is read in its place."""

  def restore(self, directory, item=None, args=None):
    index, count = jax.process_index(), jax.process_count()
    if not (epath.Path(directory) / f"process_{index}-of-{count}.json").exists():
      saved = sorted(epath.Path(directory).glob("process_0-of-*.json"))
      if saved:
        item = item or args.item
        item.set_state(json.loads(saved[0].read_text()))
        item.start_prefetch()
        return item
    return super().restore(directory, item, args)


@ocp.args.register_with_handler(_AnyProcessCountHandler, for_save=True)
@dataclasses.dataclass
class _IterSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(_AnyProcessCountHandler, for_restore=True)
@dataclasses.dataclass
class _IterRestore(ocp.args.CheckpointArgs):
  item: Any


class _Manager(ocp.CheckpointManager):
  """orbax's manager, leaving JAX's preemption sync to the train loop. JAX's protocol keeps one
  counter per process, the value of the last `reached_preemption_sync_point` call, and stops
  all at max + 1; orbax calls it with the step being saved (in `save` and its finalize thread),
  the loop once per step with its own count from 1. Mixed, a resumed run whose notice came
  before its first step waits for count 1 while the steps say 4, 5, 6: it never stops."""

  def reached_preemption(self, step: int) -> bool:
    del step
    return False

  def close(self):
    """Also joins the clean-up of temporary folders that orbax starts in a thread when it opens
    the directory and otherwise joins only in `save`: a run that stops before saving (a bad
    resume) would exit with it still running, and at exit it fails to schedule its file work
    (`RuntimeError: cannot schedule new futures after shutdown`, after the run's own error).
    A private method of orbax's (0.12): an orbax without it closes as before, and the test of
    this (tests/test_checkpoint.py) fails."""
    join = getattr(self, "_maybe_await_cleanup_tmp_directory", None)
    if join is not None:
      join()
    super().close()


class Checkpointer:
  """Saves and restores (state, data-iterator state) per step, keeping the last `keep` steps.

  `save` is asynchronous when `async_save` is set: it returns once the arrays are copied to
  host, and the files are written in the background. Call `wait()` before exiting (the SIGTERM
  path: `save(step, state, it, force=True)` then `wait()`), or `close()`.

  `timeout_s` (config.mesh.distributed_timeout_s) bounds, with several processes, the barriers
  of this class and the wait of an async save's commit for the other processes. orbax's own
  barriers inside a save are collectives over the devices, with no timeout of their own; a dead
  peer there ends the run through JAX's heartbeat, after the same time.
  """

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
               save_interval_steps: int = 1, timeout_s: int | None = None):
    if keep < 1:
      raise ValueError(f"Checkpointer keep must be at least 1, got {keep}.")
    # orbax refuses relative paths, and only in its background commit: make it absolute here.
    self.directory = epath.Path(os.path.abspath(os.path.expanduser(str(directory))))
    self._barrier = itertools.count()
    self._timeout_s = timeout_s
    self._pending_step: int | None = None
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        save_interval_steps=save_interval_steps,
        enable_async_checkpointing=async_save,
        # Temporary folders are saves that never committed, not checkpoints anyone saved.
        cleanup_tmp_directories=True,
        create=True,
        # The wait of an async save's commit for the other processes' (orbax: 20 minutes).
        **({"async_options": ocp.AsyncOptions(timeout_secs=int(timeout_s))} if timeout_s else {}),
    )
    self._mgr = _Manager(
        self.directory,
        options=options,
        item_handlers={
            STATE: ocp.StandardCheckpointHandler(),
            DATA_ITER: _AnyProcessCountHandler(),
        },
    )

  # Saving.

  def save(self, step: int, state: Any, data_iter: Any = None, *, force: bool = False) -> bool:
    """Starts saving `state` (and `data_iter`'s position) as `step`; returns whether it did.

    `force=True` saves even off the `save_interval_steps` grid (the SIGTERM save). Either way a
    step at or below the latest saved one is skipped, returning False: the same step is already
    on disk (for instance a periodic save just before SIGTERM), and overwriting it would mean
    deleting a good checkpoint before its replacement is committed (orbax's own overwrite
    removes the old folder first). A step whose folder was moved aside as corrupt is free again.
    A failure of the previous (async) save is raised here: a run whose checkpoints do not
    commit must not train on as if they did.
    """
    self._settle(raise_errors=True)
    latest = self._mgr.latest_step()
    if latest is not None and step <= latest:
      if step == latest:
        log.info("Checkpoint step %d is already saved in %s; not saving it again.", step,
                 self.directory)
      else:
        log.warning("Not saving checkpoint step %d: %s already holds the later step %d.", step,
                    self.directory, latest)
      return False
    items = {STATE: ocp.args.StandardSave(state)}
    if data_iter is not None:
      items[DATA_ITER] = _IterSave(data_iter)
    saved = self._mgr.save(step, args=ocp.args.Composite(**items), force=force)
    if saved:
      self._pending_step = step
    return saved

  def wait(self) -> None:
    """Blocks until the last save is committed; raises RuntimeError if it failed."""
    self._settle(raise_errors=True)

  def close(self) -> None:
    """Waits for the last save (logging, not raising, a failure) and releases orbax's threads."""
    self._settle(raise_errors=False)
    self._mgr.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _settle(self, *, raise_errors: bool) -> None:
    """Joins the in-flight save. Orbax re-raises its failure once, so it is reported here once.

    After a failure orbax's in-memory step list is stale (it dropped the steps it meant to
    delete, which are still on disk), so it is re-read from disk.
    """
    step, self._pending_step = self._pending_step, None
    try:
      self._mgr.wait_until_finished()
    except Exception as e:
      self._mgr.reload()
      msg = f"Saving checkpoint step {step} to {self.directory} failed: {_one_line(e)}"
      if raise_errors:
        raise RuntimeError(msg) from e
      log.error(msg)

  # Restoring.

  def latest_step(self) -> int | None:
    """The newest step on disk or being saved, unchecked; None when there is none."""
    return self._mgr.latest_step()

  def saved_data_state(self) -> tuple[int, dict] | None:
    """(step, the data iterator's state) of the newest step, unchecked (process 0's file, the
    same in every process); None when there is no step or no readable state."""
    step = self._mgr.latest_step()
    saved = [] if step is None else sorted(
        (self.directory / str(step) / DATA_ITER).glob("process_0-of-*.json"))
    try:
      return (step, json.loads(saved[0].read_text())) if saved else None
    except (OSError, ValueError):
      return None

  def saved_keys(self) -> set[str] | None:
    """Top-level keys of the newest step's saved state, unchecked; None when there is no step or
    its metadata does not read. {"params"} marks a params-only checkpoint (mtp_jax.convert)."""
    step = self._mgr.latest_step()
    if step is None:
      return None
    try:
      tree = self._mgr.item_metadata(step)[STATE].tree
      return {str(path[0]) for path in ocp.tree.to_flat_dict(tree)}
    except Exception:
      return None

  def restore_latest(self, abstract_state: Any, data_iter: Any = None):
    """Returns (state, step) from the newest step that restores cleanly, or None if none exist.

    `abstract_state` is the tree to restore into: `jax.ShapeDtypeStruct` leaves (restored with
    their `.sharding`, which may differ from the saved one) or concrete arrays. If `data_iter`
    is given its state is set to the saved one. Steps that fail are logged, moved aside to
    `corrupt-<step>-<n>` and the previous step is tried; if every step fails, RuntimeError.
    """
    self._settle(raise_errors=False)
    self._mgr.reload()
    moved = 0
    while (steps := self._mgr.all_steps()):
      step = max(steps)
      try:
        state = self._restore_step(step, abstract_state, data_iter)
      except _Corrupt as e:
        log.warning("Checkpoint step %d in %s is unusable (%s); moving it aside and trying the "
                    "previous step.", step, self.directory, e)
        self._move_aside(step)
        moved += 1
        continue
      if moved:
        log.warning("Resumed from checkpoint step %d in %s after moving %d unusable newer "
                    "step(s) aside.", step, self.directory, moved)
      return state, step
    if moved or self._corrupt_folders():
      raise RuntimeError(
          f"No usable checkpoint in {self.directory}: every step failed to restore and was "
          f"moved aside to {CORRUPT_PREFIX}* folders (remove them or use a new workdir to "
          "start afresh).")
    return None

  def _restore_step(self, step: int, abstract_state: Any, data_iter: Any) -> Any:
    """Restores one step and checks it; raises _Corrupt, or ValueError for a mismatched tree."""
    try:
      metadata = self._mgr.item_metadata(step)
      tree_metadata = metadata[STATE] if STATE in metadata else None
    except Exception as e:
      raise _Corrupt(f"its metadata does not read: {_one_line(e)}") from e
    if tree_metadata is None or not getattr(tree_metadata, "tree", None):
      raise _Corrupt("it holds no saved state, the folder is empty or partial")
    mismatch = _tree_mismatch(tree_metadata.tree, abstract_state)
    if mismatch:
      raise ValueError(
          f"Checkpoint step {step} in {self.directory} holds a different state tree than the "
          f"one to restore into ({mismatch}); restore with the config that saved it or use a "
          "new workdir.")
    try:
      restored = self._mgr.restore(
          step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state)}))
      state = restored[STATE]
    except Exception as e:
      raise _Corrupt(f"restoring the state raised {type(e).__name__}: {_one_line(e)}") from e
    problem = _restored_problem(abstract_state, state)
    if problem:
      raise _Corrupt(problem)
    if data_iter is not None:
      try:
        self._mgr.restore(
            step, args=ocp.args.Composite(**{DATA_ITER: _IterRestore(data_iter)}))
      except Exception as e:
        raise _Corrupt(f"it has no readable data-iterator state: {_one_line(e)}") from e
    return _place(abstract_state, state)

  def _move_aside(self, step: int) -> None:
    """Renames `<step>` to the first free `corrupt-<step>-<n>`, on the primary process only."""
    if jax.process_index() == 0:
      source = self.directory / str(step)
      for n in itertools.count():
        target = self.directory / f"{CORRUPT_PREFIX}{step}-{n}"
        if not target.exists():
          break
      source.rename(target)
    name = f"mtp_jax_checkpoint_move_aside_{next(self._barrier)}"
    if self._timeout_s:  # the coordination service's barrier, which has a timeout
      ocp.multihost.sync_global_processes(name, timeout=int(self._timeout_s),
                                          processes=set(range(jax.process_count())))
    else:
      ocp.multihost.sync_global_processes(name)
    self._mgr.reload()

  def _corrupt_folders(self) -> list[str]:
    if not self.directory.exists():
      return []
    return [p.name for p in self.directory.iterdir() if p.name.startswith(CORRUPT_PREFIX)]


def _one_line(e: BaseException) -> str:
  """The first line of an exception, capped: orbax and tensorstore errors run to pages."""
  text = str(e).strip().splitlines()
  return (text[0] if text else type(e).__name__)[:300]


def _path_name(path: tuple) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def _tree_mismatch(saved_tree: Any, abstract_state: Any) -> str | None:
  """Names the first leaf path or shape where an intact checkpoint differs from the target.

  Shapes and paths only: dtypes may differ on purpose (orbax casts, e.g. float32 to bfloat16).
  Paths are compared as orbax writes them (dict keys, attribute names, sequence indices).
  """
  saved = ocp.tree.to_flat_dict(saved_tree)
  wanted = ocp.tree.to_flat_dict(abstract_state)
  for path in sorted(set(saved) | set(wanted)):
    if path not in saved:
      return f"{_path_name(path)} is not in the checkpoint"
    if path not in wanted:
      return f"{_path_name(path)} is in the checkpoint but not in the target"
    saved_shape = tuple(getattr(saved[path], "shape", None) or ())
    wanted_shape = tuple(np.shape(wanted[path]))
    if saved_shape != wanted_shape:
      return f"{_path_name(path)} has shape {saved_shape} saved, {wanted_shape} wanted"
  return None


def _restored_problem(abstract_state: Any, state: Any) -> str | None:
  """Says what is wrong with a restored tree, or None: the check orbax itself does not do."""
  want_def = jax.tree.structure(abstract_state)
  got_def = jax.tree.structure(state)
  if want_def != got_def:
    return f"the restored tree has structure {got_def}, not {want_def}"
  paths_and_wanted = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  for (path, want), got in zip(paths_and_wanted, jax.tree.leaves(state)):
    name = jax.tree_util.keystr(path)
    if got is None or isinstance(got, jax.ShapeDtypeStruct):
      return f"leaf {name} was not restored"
    if np.shape(got) != np.shape(want):
      return f"leaf {name} restored with shape {np.shape(got)}, not {np.shape(want)}"
    want_dtype = getattr(want, "dtype", None)
    if want_dtype is not None and np.dtype(getattr(got, "dtype", type(got))) != want_dtype:
      return f"leaf {name} restored as {got.dtype}, not {want_dtype}"
  return None


def _place(abstract_state: Any, state: Any) -> Any:
  """Puts each restored array on the sharding its abstract leaf asks for, if orbax did not."""

  def place(want, got):
    sharding = getattr(want, "sharding", None)
    if (isinstance(got, jax.Array) and isinstance(sharding, jax.sharding.Sharding)
        and not got.sharding.is_equivalent_to(sharding, got.ndim)):
      return jax.device_put(got, sharding)
    return got

  return jax.tree.map(place, abstract_state, state)
