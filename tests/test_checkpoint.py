"""Checkpointer: exact round trips, resumable input, and the orbax traps measured in
docs/DESIGN.md."""

import logging
import os
import re
import shutil

import chex
import flax
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtp_jax import checkpoint as ckpt


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: dict
  opt_state: optax.OptState


def make_state(seed: int = 0, step: int = 0, d: int = 8) -> TrainState:
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = {"w": jax.random.normal(k1, (d, d)), "b": jax.random.normal(k2, (d,)),
            "scale": jnp.ones((d,), jnp.bfloat16)}
  tx = optax.adamw(1e-3)
  opt_state = tx.init(params)
  # One real update, so the moments are not all zeros and a mix-up would show.
  grads = jax.tree.map(jnp.ones_like, params)
  _, opt_state = tx.update(grads, opt_state, params)
  return TrainState(step=jnp.asarray(step, jnp.int32), params=params, opt_state=opt_state)


def abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


# After a failed read of a damaged step, tensorstore completes its other pending reads on
# orbax's already closed asyncio loop; Python reports that as unraisable. Harmless here.
read_failure_noise = pytest.mark.filterwarnings(
    "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")


def make_iter():
  return iter(grain.MapDataset.range(1000).shuffle(seed=0).batch(4).to_iter_dataset())


def save_steps(directory, steps, keep=3, async_save=False):
  with ckpt.Checkpointer(directory, keep=keep, async_save=async_save) as c:
    for s in steps:
      assert c.save(s, make_state(seed=s, step=s))
    c.wait()


def truncate_data_files(step_folder, keep_bytes=None):
  """Cuts tensorstore's array-data files (the `d/` folders) of a step, as a full disk would.

  All of them: which `d/` file holds which array depends on orbax's OCDBT layout (small arrays
  end up in the merged root store, the per-process copies are then never read).
  """
  for root, _, files in os.walk(step_folder):
    if os.path.basename(root) == "d":
      for name in files:
        path = os.path.join(root, name)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
          f.truncate(size // 2 if keep_bytes is None else keep_bytes)


def test_round_trip_is_exact(tmp_path):
  state = make_state(seed=1, step=7)
  with ckpt.Checkpointer(str(tmp_path)) as c:
    assert c.save(7, state)
    c.wait()
    restored, step = c.restore_latest(abstract(state))
    from_concrete, _ = c.restore_latest(make_state())  # concrete arrays describe the target too
  assert step == 7
  chex.assert_trees_all_equal(restored, state)
  chex.assert_trees_all_equal(from_concrete, state)
  assert jax.tree.structure(restored) == jax.tree.structure(state)


def test_no_checkpoint_gives_none(tmp_path):
  with ckpt.Checkpointer(str(tmp_path / "checkpoints")) as c:
    assert c.latest_step() is None
    assert c.restore_latest(abstract(make_state())) is None


def test_data_iterator_resumes_with_the_same_batches(tmp_path):
  it = make_iter()
  for _ in range(5):
    next(it)
  state = make_state()
  with ckpt.Checkpointer(str(tmp_path)) as c:
    c.save(5, state, it)  # async: the loop consumes more while the files are written
    expected = [next(it) for _ in range(3)]
    c.wait()
  fresh = make_iter()
  with ckpt.Checkpointer(str(tmp_path)) as c:
    _, step = c.restore_latest(abstract(state), fresh)
  assert step == 5
  chex.assert_trees_all_equal([next(fresh) for _ in range(3)], expected)


def test_keeps_the_last_n_steps(tmp_path):
  save_steps(str(tmp_path), range(1, 6), keep=2)
  assert sorted(os.listdir(tmp_path)) == ["4", "5"]


def test_async_save_then_wait_restores_in_a_fresh_object(tmp_path):
  """The SIGTERM path: save(force=True), wait(), exit; the next process resumes."""
  state = make_state(seed=3, step=11)
  expected = jax.tree.map(np.asarray, state)
  c = ckpt.Checkpointer(str(tmp_path), async_save=True)
  assert c.save(11, state, force=True)
  # The train step donates its state right after: the save must not need the buffers any more.
  for x in jax.tree.leaves(state):
    x.delete()
  c.wait()
  c.close()
  with ckpt.Checkpointer(str(tmp_path)) as fresh:
    assert fresh.latest_step() == 11
    restored, step = fresh.restore_latest(abstract(make_state()))
  assert step == 11
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored), expected)


@read_failure_noise
@pytest.mark.parametrize("damage, reason", [
    ("empty_folder", "no saved state"),
    # The step's metadata includes zarr headers kept in the same OCDBT data files.
    ("truncated_data_file", "(metadata does not read|restoring the state raised)"),
])
def test_corrupt_latest_falls_back_and_is_moved_aside(tmp_path, caplog, damage, reason):
  save_steps(str(tmp_path), [1, 2, 3])
  latest = tmp_path / "3"
  if damage == "empty_folder":
    shutil.rmtree(latest)
    latest.mkdir()
  else:
    truncate_data_files(latest)
  with caplog.at_level(logging.WARNING, logger="mtp_jax.checkpoint"):
    with ckpt.Checkpointer(str(tmp_path)) as c:
      assert c.latest_step() == 3  # orbax lists the damaged step as the latest one
      restored, step = c.restore_latest(abstract(make_state()))
      assert c.latest_step() == 2
  assert step == 2
  chex.assert_trees_all_equal(restored, make_state(seed=2, step=2))
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any(f"step 3 in {tmp_path}" in m and re.search(reason, m) for m in warnings), warnings
  assert sorted(os.listdir(tmp_path)) == ["1", "2", "corrupt-3-0"]
  if damage == "truncated_data_file":  # moved aside whole, not deleted
    assert os.listdir(tmp_path / "corrupt-3-0" / "state")


@read_failure_noise
def test_every_step_corrupt_raises_naming_the_directory(tmp_path):
  save_steps(str(tmp_path), [1, 2])
  for step in ("1", "2"):
    truncate_data_files(tmp_path / step, keep_bytes=1)
  with ckpt.Checkpointer(str(tmp_path)) as c:
    with pytest.raises(RuntimeError, match="No usable checkpoint in " + str(tmp_path)):
      c.restore_latest(abstract(make_state()))
  assert sorted(os.listdir(tmp_path)) == ["corrupt-1-0", "corrupt-2-0"]
  # A rerun must not silently start from scratch over a folder of corrupt checkpoints.
  with ckpt.Checkpointer(str(tmp_path)) as c:
    with pytest.raises(RuntimeError, match="No usable checkpoint"):
      c.restore_latest(abstract(make_state()))


@read_failure_noise
def test_save_after_fallback_reuses_the_corrupt_step_number(tmp_path):
  save_steps(str(tmp_path), [1, 2, 3])
  truncate_data_files(tmp_path / "3")
  with ckpt.Checkpointer(str(tmp_path)) as c:
    _, step = c.restore_latest(abstract(make_state()))
    assert step == 2
    assert c.save(3, make_state(seed=30, step=3))
    c.wait()
    restored, step = c.restore_latest(abstract(make_state()))
  assert step == 3
  chex.assert_trees_all_equal(restored, make_state(seed=30, step=3))
  assert "corrupt-3-0" in os.listdir(tmp_path)
  # And a second corruption of the same step number gets its own folder.
  truncate_data_files(tmp_path / "3")
  with ckpt.Checkpointer(str(tmp_path)) as c:
    assert c.restore_latest(abstract(make_state()))[1] == 2
  assert {"corrupt-3-0", "corrupt-3-1"} <= set(os.listdir(tmp_path))


def test_saving_an_existing_step_is_skipped(tmp_path):
  first = make_state(seed=1, step=4)
  with ckpt.Checkpointer(str(tmp_path)) as c:
    assert c.save(4, first)
    # SIGTERM right after a periodic save, while it is still being written.
    assert not c.save(4, make_state(seed=2, step=4), force=True)
    assert not c.save(3, make_state(seed=2, step=3), force=True)
    c.wait()
    restored, _ = c.restore_latest(abstract(first))
  chex.assert_trees_all_equal(restored, first)


def test_force_saves_off_the_interval_grid(tmp_path):
  with ckpt.Checkpointer(str(tmp_path), async_save=False, save_interval_steps=10) as c:
    assert c.save(10, make_state(step=10))
    assert not c.save(15, make_state(step=15))
    assert c.save(15, make_state(step=15), force=True)
    assert c.latest_step() == 15


def test_missing_data_iterator_state_falls_back(tmp_path, caplog):
  with ckpt.Checkpointer(str(tmp_path), async_save=False) as c:
    c.save(1, make_state(seed=1), make_iter())
    c.save(2, make_state(seed=2))  # no iterator
  with caplog.at_level(logging.WARNING, logger="mtp_jax.checkpoint"):
    with ckpt.Checkpointer(str(tmp_path)) as c:
      _, step = c.restore_latest(abstract(make_state()), make_iter())
  assert step == 1
  assert any("data-iterator" in r.getMessage() for r in caplog.records)


def test_mismatched_target_raises_and_moves_nothing(tmp_path):
  """A config change is not corruption: it must not shunt every step of the run aside."""
  save_steps(str(tmp_path), [1, 2])
  with ckpt.Checkpointer(str(tmp_path)) as c:
    with pytest.raises(ValueError, match=r"step 2 .*has shape \(8,\) saved, \(16,\) wanted"):
      c.restore_latest(jax.eval_shape(lambda: make_state(d=16)))  # no compiles
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_restores_into_the_requested_sharding(tmp_path):
  state = make_state(seed=5)
  save_steps(str(tmp_path), [1])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                        state)
  with ckpt.Checkpointer(str(tmp_path)) as c:
    restored, _ = c.restore_latest(target)
  for leaf in jax.tree.leaves(restored):
    assert leaf.sharding.is_equivalent_to(replicated, leaf.ndim)
  chex.assert_trees_all_equal(restored, make_state(seed=1, step=1))


def test_failed_commit_keeps_the_last_good_step(tmp_path, monkeypatch):
  """Orbax deletes old steps only after the new step's commit succeeded (checked with keep=1).

  The failure is injected at orbax's private commit hook; if that moves in a new orbax
  release, re-check the ordering in CheckpointManager._finalize and update this test.
  """
  from orbax.checkpoint._src.checkpointers import async_checkpointer
  if not hasattr(async_checkpointer, "_on_commit_callback"):
    message = "orbax moved its commit hook; re-check GC ordering by hand."
    if os.environ.get("CI"):  # the pinned orbax has it: under CI a skip would hide the check
      pytest.fail(message)
    pytest.skip(message)
  save_steps(str(tmp_path), [1], keep=1)

  def fail(*args, **kwargs):
    raise OSError("disk full (simulated)")

  with ckpt.Checkpointer(str(tmp_path), keep=1, async_save=True) as c:
    monkeypatch.setattr(async_checkpointer, "_on_commit_callback", fail)
    assert c.save(2, make_state(seed=2, step=2))
    with pytest.raises(RuntimeError, match="Saving checkpoint step 2 .* failed"):
      c.wait()
    monkeypatch.undo()
    assert "1" in os.listdir(tmp_path)
    restored, step = c.restore_latest(abstract(make_state()))
    assert step == 1
    chex.assert_trees_all_equal(restored, make_state(seed=1, step=1))
    # The run goes on: the next save commits, and only then is step 1 collected.
    assert c.save(3, make_state(seed=3, step=3))
    c.wait()
  assert [p for p in sorted(os.listdir(tmp_path)) if "tmp" not in p] == ["3"]


def test_close_joins_the_clean_up_of_temporary_folders(tmp_path, monkeypatch):
  """A Checkpointer closed before any save (a run stopped by a bad resume) has finished orbax's
  clean-up of an unfinished save's folder: left running, it fails at interpreter exit with a
  traceback after the run's one-line error. The clean-up is slowed so a close that does not
  join it returns first."""
  import asyncio

  from orbax.checkpoint._src.path import atomicity_types, temporary_paths
  found = temporary_paths.all_temporary_paths

  async def slow(*args, **kwargs):
    await asyncio.sleep(0.5)
    return await found(*args, **kwargs)

  monkeypatch.setattr(temporary_paths, "all_temporary_paths", slow)
  save_steps(str(tmp_path), [1])
  unfinished = tmp_path / f"2{atomicity_types.TMP_DIR_SUFFIX}1234"
  unfinished.mkdir()
  ckpt.Checkpointer(str(tmp_path)).close()
  assert sorted(os.listdir(tmp_path)) == ["1"]
