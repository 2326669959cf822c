"""The train state and the pure, jittable steps the loop in train.py drives:

    state = init_state(model, tx, config, mesh, rng)
    state, metrics = jax.jit(make_train_step(model, tx, config))(state, batch)

or, all at once (what train.py and the benchmarks in experiments/ use):

    t = build_training(config)   # model, tx, mesh, shardings, jitted step (donates the state)
    state, metrics = t.step(t.init_state(seed), batch)

plus the shardings and abstract shapes a restore fills in, and the hashes that make exact resume
checkable (`params_sha256` in a workdir's summary.json).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from mtp_jax import backends
from mtp_jax import loss as loss_lib
from mtp_jax import optimizer as optim_lib
from mtp_jax import sharding as shard_lib
from mtp_jax.model import MTPModel


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class Training:
  """What a training step needs, built once from a config by `build_training`."""
  config: ml_collections.ConfigDict
  model: MTPModel
  tx: optax.GradientTransformation
  mesh: jax.sharding.Mesh
  state_shardings: Any
  batch_sharding: jax.sharding.NamedSharding
  step: Any  # jitted (state, batch) -> (state, metrics); donates the state

  def init_state(self, seed: int = 0) -> TrainState:
    return init_state(self.model, self.tx, self.config, self.mesh, jax.random.PRNGKey(seed),
                      self.state_shardings)

  def abstract_state(self) -> TrainState:
    return abstract_state(self.model, self.tx, self.config, self.mesh, self.state_shardings)


def build_training(config: ml_collections.ConfigDict, mesh=None) -> Training:
  """The model, optimizer, mesh (`make_mesh(config)` unless given), state and batch shardings
  and the jitted train step of `config`."""
  from mtp_jax.model import build_model
  mesh = shard_lib.make_mesh(config) if mesh is None else mesh
  model = build_model(config)
  tx = optim_lib.make_optimizer(config)
  state_sh = state_shardings(model, tx, config, mesh)
  batch_sh = shard_lib.batch_sharding(mesh)
  step = jax.jit(make_train_step(model, tx, config), in_shardings=(state_sh, batch_sh),
                 out_shardings=(state_sh, None), donate_argnums=0)
  return Training(config, model, tx, mesh, state_sh, batch_sh, step)


def batch_slices(config: ml_collections.ConfigDict) -> int:
  """train.batch_slices resolved (static: while building or tracing): the set value, or for 0
  (auto) the backend's choice for a micro-batch's rows (2 on one CPU device of 2 cores, else 1:
  `backends.cpu.ops.batch_slices_auto`)."""
  t = config.train
  if t.batch_slices:
    return t.batch_slices
  return backends.current().batch_slices_auto(t.batch_size // t.grad_accum)


def _dummy_tokens(config):
  return jnp.zeros((1, min(8, config.data.seq_len)), jnp.int32)


def _boxed_state(model: MTPModel, tx, config, rng) -> TrainState:
  """Train state whose leaves keep their logical-partitioning boxes (for shardings)."""
  params = model.init(rng, _dummy_tokens(config))["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def state_shardings(model, tx, config, mesh):
  boxed = jax.eval_shape(lambda r: _boxed_state(model, tx, config, r), jax.random.PRNGKey(0))
  # optax.multi_transform (optim.trainable = "heads") leaves a MaskedNode (boxed), a NamedTuple
  # with no leaves, where a group keeps no state; the logical-sharding helpers read it as a spec.
  boxes = lambda x: isinstance(x, (optax.MaskedNode, nn.meta.AxisMetadata))
  masked = lambda x: isinstance(nn.unbox(x) if boxes(x) else x, optax.MaskedNode)
  leaves, treedef = jax.tree.flatten(boxed, is_leaf=boxes)
  shardings = iter(shard_lib.logical_shardings([x for x in leaves if not masked(x)], mesh, config))
  return treedef.unflatten([optax.MaskedNode() if masked(x) else next(shardings) for x in leaves])


def abstract_state(model, tx, config, mesh, shardings=None) -> TrainState:
  """ShapeDtypeStructs (with shardings) of the unboxed train state: what restore fills in.
  `shardings`: `state_shardings(model, tx, config, mesh)` where the caller has them (each call
  traces the model's init once more)."""
  shapes = jax.eval_shape(
      lambda r: nn.unbox(_boxed_state(model, tx, config, r)), jax.random.PRNGKey(0))
  shardings = state_shardings(model, tx, config, mesh) if shardings is None else shardings
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


def init_state(model, tx, config, mesh, rng, shardings=None) -> TrainState:
  shardings = state_shardings(model, tx, config, mesh) if shardings is None else shardings
  init = jax.jit(lambda r: nn.unbox(_boxed_state(model, tx, config, r)), out_shardings=shardings)
  return init(rng)


def make_grad_fn(model: MTPModel, config: ml_collections.ConfigDict, draft_ids=None):
  """Pure (params, batch, step=0) -> (grads, metrics) of the weighted per-head loss (loss.py).
  `step` (the train state's) sets lambda_i where they change over training
  (loss.head_weights_at: loss.mtp_lambda_schedule, loss.head_curriculum); metrics carry them as
  head_weight.

  With `train.grad_accum = A` the batch is scanned as A micro-batches. Each one adds its per-head
  sums (NLL, lse^2, correct, agreeing, tokens) and the gradient of sum_i lambda_i * sums_i /
  count_i, where count_i is head i's token count in the whole batch (it depends on the batch
  alone, not on the params). So grads and metrics equal A = 1 up to summation order, however
  unevenly padding or packed documents spread the tokens over the micro-batches; averaging
  per-micro-batch means would not. `train.batch_slices` (`batch_slices`) cuts each micro-batch
  into row slices the same way, but side by side instead of one after another.
  """
  accum = config.train.grad_accum
  weights_N = loss_lib.head_weights(config)
  z_loss = config.loss.z_loss

  # optim.trainable = "heads": frozen params behind lax.stop_gradient (no trunk backward), and
  # head 1's loss, which depends on frozen params only, outside the gradient.
  heads_only = config.optim.trainable == "heads"
  trained = optim_lib.trained_slots(config) if heads_only else None

  def objective(params, batch, count_N, weights_N):
    if heads_only:
      params = optim_lib.stop_frozen_gradients(params, trained)
    sums = loss_lib.model_sums(params, model, config, batch, frozen_heads=int(heads_only),
                               draft_ids=draft_ids)
    return loss_lib.weighted_loss(sums, weights_N, z_loss, count_N), sums

  objective_grad = jax.grad(objective, has_aux=True)

  def counts(batch):
    return loss_lib.head_token_counts(batch["tokens"], batch.get("segment_ids"), len(weights_N))

  def split_rows(batch, n):
    """Every leaf [rows, ...] -> [n, rows / n, ...]: micro-batches and slices alike."""
    return jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)

  def grads_and_sums(params, batch, count_N, weights_N):
    """Gradients and sums of `batch`, its rows cut into `batch_slices` slices computed side by
    side (independent programs XLA runs at once) and summed: every slice divides by the whole
    batch's token counts, as micro-batches do. Resolved here, while tracing: the mesh in
    context (plan_memory's TPU target, say) decides auto."""
    slices = batch_slices(config)
    if slices == 1:
      return objective_grad(params, batch, count_N, weights_N)
    count_N = counts(batch) if count_N is None else count_N
    split = split_rows(batch, slices)
    parts = [objective_grad(params, jax.tree.map(lambda x, i=i: x[i], split), count_N, weights_N)
             for i in range(slices)]
    return functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), parts)

  def grad_fn(params, batch, step=0):
    w_N = loss_lib.head_weights_at(config, step) if loss_lib.weights_vary(config) else weights_N
    if accum == 1:
      grads, sums = grads_and_sums(params, batch, None, w_N)
    else:
      count_N = counts(batch)
      micro = split_rows(batch, accum)

      def body(carry, mb):
        return jax.tree.map(jnp.add, carry, grads_and_sums(params, mb, count_N, w_N)), None

      zeros = jax.eval_shape(grads_and_sums, params, jax.tree.map(lambda x: x[0], micro), count_N,
                             w_N)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
      (grads, sums), _ = jax.lax.scan(body, zeros, micro)
    return grads, dict(loss_lib.summarise(sums, w_N, z_loss)[1], head_weight=w_N)

  return grad_fn


def apply_updates(params, updates):
  """optax.apply_updates, except that a zero update leaves the parameter as it was: p + 0.0
  turns a -0.0 into +0.0, and frozen parameters (optim.trainable = "heads") must stay
  bit-identical."""
  return jax.tree.map(lambda p, u: jnp.where(u == 0, p, (p + u).astype(p.dtype)), params,
                      updates)


def make_train_step(model: MTPModel, tx, config: ml_collections.ConfigDict, draft_ids=None):
  """Pure (state, batch) -> (state, metrics): gradients (`make_grad_fn`), the optax update, and
  the non-finite-step counts of `optax.apply_if_finite`. `draft_ids`: heads 2..n train over
  that draft vocabulary (loss.mtp_sums)."""
  grad_fn = make_grad_fn(model, config, draft_ids)
  # Frozen params must stay bit-identical; elsewhere optax's plain sum is all a step needs.
  update_params = apply_updates if config.optim.trainable == "heads" else optax.apply_updates
  nan_steps = tuple(config.train.debug_nonfinite_steps)

  def train_step(state: TrainState, batch):
    grads, metrics = grad_fn(state.params, batch, state.step)
    if nan_steps:  # fault injection for the reliability tests only: traced when asked for
      poison = jnp.any(jnp.asarray(nan_steps, jnp.int32) == state.step)
      grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = update_params(state.params, updates)
    consecutive, total = optim_lib.nonfinite_counts(opt_state)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads),
                   nonfinite_consecutive=consecutive, nonfinite_total=total)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def make_eval_step(model: MTPModel, config):
  """Pure (params, batch) -> the batch's per-head sums (`loss.mtp_sums`, with the sampled
  acceptance's): they add up over batches, and `loss.summarise` of the total gives the metrics."""
  def eval_step(params, batch):
    return loss_lib.model_sums(params, model, config, batch, accept=True)
  return eval_step


# Elements per hashed block of a parameter (`params_sha256`): blocks are runs of the leaf's
# C-order elements, defined by global index, so their digests do not depend on the layout.
HASH_BLOCK = 2 ** 16


def _block_digests_host(x: np.ndarray) -> list[bytes]:
  flat = np.ascontiguousarray(x).reshape(-1)
  return [hashlib.sha256(flat[i:i + HASH_BLOCK].tobytes()).digest()
          for i in range(0, flat.size, HASH_BLOCK)]


def _flat_padded(x, pad: int):
  return jnp.pad(x.reshape(-1), (0, pad))


@functools.lru_cache(maxsize=256)
def _relayout(pad: int, sharding: jax.sharding.NamedSharding):
  return jax.jit(functools.partial(_flat_padded, pad=pad), out_shardings=sharding)


def relaid_for_hashing(leaf: jax.Array) -> tuple[jax.Array, int]:
  """`leaf` flattened in C order, zero-padded and sharded over its own devices so that each
  holds whole HASH_BLOCK blocks (device i the i-th run of them), and the blocks per device: a
  jitted re-layout, its output sharded, never replicated on every device. XLA moves a leaf of a
  block or more per device in parts (all-to-all, permutes); one of fewer blocks than devices
  it may gather whole inside the program (XLA:CPU does: tests/test_params_hash.py)."""
  devices = sorted(leaf.sharding.device_set, key=lambda d: d.id)
  n_blocks = -(-leaf.size // HASH_BLOCK)
  per_device = -(-n_blocks // len(devices))
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(devices), ("blocks",)),
                                        jax.sharding.PartitionSpec("blocks"))
  pad = per_device * len(devices) * HASH_BLOCK - leaf.size
  return _relayout(pad, sharding)(leaf), per_device


def _block_digests(leaf) -> list[bytes]:
  """sha256 of each HASH_BLOCK block of `leaf`'s C-order elements, in global order. A sharded
  leaf is hashed where it lies: each process hashes the blocks its devices hold after
  `relaid_for_hashing` and only the 32-byte digests are gathered across processes. A leaf
  every device holds whole is hashed from this process's copy, with no program and no gather."""
  if not isinstance(leaf, jax.Array):
    return _block_digests_host(np.asarray(leaf))
  if leaf.sharding.is_fully_replicated:  # every process holds it all already (a norm's scale)
    return _block_digests_host(np.asarray(leaf.addressable_data(0)))
  if leaf.size == 0:
    return []
  n_blocks = -(-leaf.size // HASH_BLOCK)
  relaid, per_device = relaid_for_hashing(leaf)
  digests = {}
  for shard in relaid.addressable_shards:
    first = (shard.index[0].start or 0) // HASH_BLOCK
    data = np.asarray(shard.data)
    for j in range(per_device):
      if first + j < n_blocks:  # the last block stops at the leaf's end; padding is not hashed
        stop = min(HASH_BLOCK, leaf.size - (first + j) * HASH_BLOCK)
        digests[first + j] = hashlib.sha256(data[j * HASH_BLOCK:j * HASH_BLOCK + stop]
                                            .tobytes()).digest()
  if jax.process_count() > 1:  # the digests of every block, one row each (a collective)
    from jax.experimental import multihost_utils
    rows = np.zeros((per_device * len(relaid.sharding.device_set), 32), np.uint8)
    for i, d in digests.items():
      rows[i] = np.frombuffer(d, np.uint8)
    local = [jax.device_put(rows[(s.index[0].start or 0) // HASH_BLOCK:][:per_device], s.device)
             for s in relaid.addressable_shards]
    table = multihost_utils.process_allgather(jax.make_array_from_single_device_arrays(
        rows.shape, relaid.sharding, local), tiled=True)
    return [np.asarray(table[i]).tobytes() for i in range(n_blocks)]
  return [digests[i] for i in range(n_blocks)]


def params_sha256(params) -> str:
  """sha256 over every parameter's path, shape, dtype and HASH_BLOCK block digests (blocks by
  global C-order index), leaves in sorted-path order: the same for any devices and process
  count, and no process gathers another's parameters (`_block_digests`). Every process must
  call it (a collective when there are several)."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
    h.update(jax.tree_util.keystr(path).encode())
    dtype = np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
    h.update(f"{dtype.name}{tuple(np.shape(leaf))}".encode())
    for digest in _block_digests(leaf):
      h.update(digest)
  return h.hexdigest()


def batches_sha256(batches) -> str:
  h = hashlib.sha256()
  for b in batches:
    for k in sorted(b):
      h.update(np.ascontiguousarray(b[k]).tobytes())
  return h.hexdigest()
