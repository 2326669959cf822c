"""Sharded runs against one device, on 8 simulated CPU devices, in a process of their own.

    python tests/sharding_check.py OUT.json [CHECK ...]   (default: all but HEAVY_CHECKS)

tests/test_sharding.py runs this once per tier (the device count is fixed when jax starts, so
the rest of the suite keeps one device) and asserts on the JSON it writes: make test the default
checks, the heavy tier HEAVY_CHECKS. One process, so that jax starts once and each
program compiles once. Meshes (data, fsdp, tensor) = (8,1,1), (1,8,1), (2,2,2); every head
kind; a model whose sharded sizes divide by 8 (d_model 64, vocab 64 padded to 128 rows by the
default model.vocab_multiple, 4 attention heads, 2 kv heads, d_ff 128); and the byte vocabulary
(259 ids, 384 rows) on (2,2,2), which `tensor` = 2 refuses unpadded.
"""
from __future__ import annotations

import os
import sys

N_DEVICES = 8
if "jax" in sys.modules:
  raise RuntimeError("sharding_check must set the device count before jax is imported")
_COUNT = "--xla_force_host_platform_device_count"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_COUNT)]
    + [f"{_COUNT}={N_DEVICES}"])
os.environ["JAX_PLATFORMS"] = "cpu"
# Off: a train step read from the cache would not log XLA's warnings (xla_log.compile_logged).
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import functools  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from conftest import random_params  # noqa: E402  (adds the fast-compile flags, imports jax)
import xla_log  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mtp_jax import config as config_lib  # noqa: E402
from mtp_jax.decoding import decode as decode_lib  # noqa: E402
from mtp_jax import loss as loss_lib  # noqa: E402
from mtp_jax import optimizer as optim_lib  # noqa: E402
from mtp_jax import distributed, sharding as shard_lib  # noqa: E402
from mtp_jax import steps as train_lib  # noqa: E402
from mtp_jax.checkpoint import Checkpointer  # noqa: E402
from mtp_jax.model import build_model  # noqa: E402

KINDS = ("parallel", "projection", "sequential")
HEAVY_CHECKS = ("loss_grads_one_axis", "byte_vocab")  # run when named (the heavy tier)
# f32; ATOL is a floor for entries near 0, where shards summed in another order leave ~5e-7.
RTOL, ATOL = 1e-5, 1e-6
PAD, EOS = 62, 63
HEADS_ON_TENSOR = (("mtp_heads", "tensor"),)  # put first: flax takes rules in order


def make_config(kind="parallel", n_future=2, mesh=(1, 1, 1), first_rules=()):
  c = config_lib.base_config()
  c.model.update(vocab_size=64, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                 max_len=64, n_future=n_future)
  c.model.heads.kind = kind
  c.data.seq_len = 16
  c.train.batch_size = 8
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  names = {name for name, _ in first_rules}
  c.mesh.rules = tuple(first_rules) + tuple(r for r in c.mesh.rules if r[0] not in names)
  return c


def make_batch(seed=0):
  """Two packed documents per row, so segment masking is sharded too."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 62, size=(8, 16)).astype(np.int32)
  seg = np.ones((8, 16), np.int32)
  seg[:, 9:] = 2
  return {"tokens": tokens, "segment_ids": seg}


def check_same_structure(a_tree, b_tree, what: str) -> None:
  """Leaves are compared pairwise by zip, which would silently drop a leaf missing on one side:
  the two trees must have one structure first."""
  a_def, b_def = jax.tree.structure(a_tree), jax.tree.structure(b_tree)
  if a_def != b_def:
    a_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(a_tree)[0]}
    b_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(b_tree)[0]}
    raise AssertionError(f"{what}: the trees differ in structure; only in the first: "
                         f"{sorted(a_paths - b_paths)[:5]}, only in the second: "
                         f"{sorted(b_paths - a_paths)[:5]} ({a_def} != {b_def})")


def compare(a_tree, b_tree) -> dict:
  """Worst |a - b| / (ATOL + RTOL |b|) over all leaves (<= 1 passes allclose), and where; the
  trees must have one structure."""
  check_same_structure(a_tree, b_tree, "compare")
  worst, where, max_abs, max_ref = 0.0, "", 0.0, 0.0
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(a_tree)[0],
                          jax.tree.leaves(b_tree)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = np.abs(a - b)
    ratio = float(np.max(diff / (ATOL + RTOL * np.abs(b)))) if diff.size else 0.0
    max_abs = max(max_abs, float(diff.max()) if diff.size else 0.0)
    max_ref = max(max_ref, float(np.abs(b).max()) if b.size else 0.0)
    if ratio > worst:
      worst, where = ratio, jax.tree_util.keystr(path)
  return {"worst_ratio": worst, "worst_leaf": where, "max_abs_diff": max_abs,
          "max_abs_ref": max_ref}


def specs(shardings) -> dict:
  return {jax.tree_util.keystr(p): str(s.spec)
          for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}


def loss_and_grads(config, params, batch, mesh=None):
  """((loss, metrics), grads) on one device, or jitted over `mesh` with the train state's
  param shardings and the batch sharding, activations constrained by the rules."""
  model = build_model(config)
  fn = jax.value_and_grad(lambda p, b: loss_lib.model_loss(p, model, config, b), has_aux=True)
  if mesh is None:
    return jax.device_get(jax.jit(fn)(params, batch)), None
  tx = optim_lib.make_optimizer(config)
  param_sh = train_lib.state_shardings(model, tx, config, mesh).params
  batch_sh = shard_lib.batch_sharding(mesh)
  args = (jax.device_put(params, param_sh), jax.device_put(batch, batch_sh))
  with shard_lib.activation_rules(mesh, config):
    step = jax.jit(fn, in_shardings=(param_sh, batch_sh), out_shardings=(None, param_sh))
    text = step.lower(*args).as_text()
    out = step(*args)
  n_constraints = text.count("sdy.sharding_constraint") + text.count("@Sharding")
  return jax.device_get(out), (param_sh, n_constraints)


def family(c):
  """Every model-family feature at once: q/k/v biases (sharded like their kernels), q/k norms,
  head_dim 8 != 64 / 4, llama3 RoPE, a 5-token window."""
  c.model.update(qkv_bias=True, qk_norm=True, head_dim=8, sliding_window=5,
                 rope_scaling="llama3", rope_factor=4.0, rope_original_max_len=8)
  return c


def check_loss_grads(results, meshes=((2, 2, 2),), heads_on_tensor=True):
  """Every kind on `meshes` (default (2,2,2): data, fsdp, tensor; `heads_on_tensor`: the
  stacked heads on tensor too) against one device. Parallel runs carry the family features
  (`family`), checked sharded without compiles of their own; the plain parallel model is
  check_byte_vocab's and others'."""
  batch = make_batch()
  for kind in KINDS:
    cfg_of = family if kind == "parallel" else (lambda c: c)
    base_cfg = cfg_of(make_config(kind))
    params = random_params(build_model(base_cfg), seed=1)
    (ref_loss, ref_m), ref_g = loss_and_grads(base_cfg, params, batch)[0]
    runs = [(f"{kind}/{','.join(map(str, m))}", cfg_of(make_config(kind, mesh=m)), m)
            for m in meshes]
    if heads_on_tensor and kind in ("parallel", "sequential"):  # stacked heads on `tensor`
      n = 2 if kind == "parallel" else 3
      c = cfg_of(make_config(kind, n_future=n, mesh=(2, 2, 2), first_rules=HEADS_ON_TENSOR))
      runs.append((f"{kind}/2,2,2/mtp_heads=tensor/n{n}", c, (2, 2, 2)))
    for name, cfg, _mesh in runs:
      t0 = time.perf_counter()
      if cfg.model.n_future != base_cfg.model.n_future:
        p = random_params(build_model(cfg), seed=1)
        (rl, rm), rg = loss_and_grads(cfg, p, batch)[0]
      else:
        p, rl, rm, rg = params, ref_loss, ref_m, ref_g
      ((loss, metrics), grads), (param_sh, n_constraints) = loss_and_grads(
          cfg, p, batch, shard_lib.make_mesh(cfg))
      sp = specs(param_sh)
      results["loss_grads"][name] = {
          "loss": float(loss), "loss_one_device": float(rl),
          "loss_cmp": compare(loss, rl), "head_loss_cmp": compare(metrics["head_loss"],
                                                                  rm["head_loss"]),
          "grads_cmp": compare(grads, rg),
          "sharded_leaves": sum(not s.is_fully_replicated for s in jax.tree.leaves(param_sh)),
          "head_specs": {k: v for k, v in sp.items() if "['heads']" in k},
          "bias_specs": {k: v for k, v in sp.items() if k.endswith("['bias']")},
          "family": bool(cfg.model.qkv_bias),
          "activation_constraints": n_constraints,
          "seconds": round(time.perf_counter() - t0, 2)}
      print(name, results["loss_grads"][name]["grads_cmp"], f"{time.perf_counter() - t0:.1f}s",
            flush=True)


def random_state(abstract, seed=0):
  """A train state with random values on the abstract state's shardings, nothing compiled."""
  rng = np.random.default_rng(seed)

  def draw(s):
    if jnp.issubdtype(s.dtype, jnp.floating):
      x = rng.standard_normal(s.shape).astype(s.dtype)
    else:
      x = rng.integers(0, 100, size=s.shape).astype(s.dtype)
    return jax.device_put(x, s.sharding)
  return jax.tree.map(draw, abstract)


def device0_bytes(tree) -> tuple[int, int]:
  """(bytes held on device 0, total bytes) over the leaves of a tree of sharded arrays."""
  dev = jax.devices()[0]
  local = sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
              if s.device == dev)
  return local, sum(x.nbytes for x in jax.tree.leaves(tree))


def check_bytes_and_checkpoint(results, workdir):
  cfg = make_config("parallel", mesh=(1, 8, 1))
  model, tx = build_model(cfg), optim_lib.make_optimizer(cfg)
  mesh = shard_lib.make_mesh(cfg)
  state = random_state(train_lib.abstract_state(model, tx, cfg, mesh))
  p_local, p_total = device0_bytes(state.params)
  o_local, o_total = device0_bytes(state.opt_state)
  results["bytes_fsdp8"] = {"params_device0": p_local, "params_total": p_total,
                            "opt_device0": o_local, "opt_total": o_total}
  print("bytes", results["bytes_fsdp8"], flush=True)
  ckpt_dir = os.path.join(workdir, "ckpt")
  with Checkpointer(ckpt_dir) as ck:
    ck.save(1, state, force=True)
    ck.wait()
  saved = jax.device_get(state)
  out = {}
  for target in ((2, 2, 2), (8, 1, 1), (1, 1, 1)):
    c = make_config("parallel", mesh=target)
    m = shard_lib.make_mesh(c, jax.devices()[:int(np.prod(target))])
    abstract = train_lib.abstract_state(model, tx, c, m)
    with Checkpointer(ckpt_dir) as ck:
      restored, step = ck.restore_latest(abstract)
    check_same_structure(saved, jax.device_get(restored), "restored state")
    check_same_structure(restored, abstract, "restored state against its target")
    same_values = all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(restored))))
    same_sharding = all(r.sharding.is_equivalent_to(a.sharding, r.ndim) for r, a in zip(
        jax.tree.leaves(restored), jax.tree.leaves(abstract)))
    out[",".join(map(str, target))] = {"step": step, "values_equal": same_values,
                                       "shardings_as_asked": same_sharding,
                                       "n_devices": len(m.devices.flat)}
  results["checkpoint_from_1,8,1"] = out
  print("checkpoint", out, flush=True)


def check_train_step(results):
  """A train step on (2,2,2) against one device; XLA's log of its partitioning (no remat)."""
  batch = make_batch(1)
  outs, remat = {}, {"control": xla_log.remat_control(shard_lib.make_mesh(make_config(
      mesh=(2, 2, 2))))}
  for m in ((1, 1, 1), (2, 2, 2)):
    cfg = make_config("parallel", mesh=m)
    model, tx = build_model(cfg), optim_lib.make_optimizer(cfg)
    mesh = shard_lib.make_mesh(cfg, jax.devices()[:int(np.prod(m))])
    abstract = train_lib.abstract_state(model, tx, cfg, mesh)
    params = random_params(model, seed=2)
    state = jax.tree.map(lambda s, x: jax.device_put(x, s.sharding), abstract,
                         train_lib.TrainState(step=np.zeros((), np.int32), params=params,
                                              opt_state=tx.init(params)))
    state_sh = jax.tree.map(lambda s: s.sharding, abstract)
    batch_sh = shard_lib.batch_sharding(mesh)
    with shard_lib.activation_rules(mesh, cfg):
      step = jax.jit(train_lib.make_train_step(model, tx, cfg), in_shardings=(state_sh, batch_sh),
                     out_shardings=(state_sh, None), donate_argnums=0)
      args = (state, shard_lib.shard_batch(batch, batch_sh))
      compiled, remat[m] = xla_log.compile_logged(step.lower(*args))
      state, metrics = compiled(*args)
    outs[m] = jax.device_get((state.params, {k: metrics[k] for k in ("loss", "grad_norm")}))
  results["train_step_2,2,2"] = {"params_cmp": compare(outs[(2, 2, 2)][0], outs[(1, 1, 1)][0]),
                                 "metrics_cmp": compare(outs[(2, 2, 2)][1], outs[(1, 1, 1)][1]),
                                 "remat_warnings": xla_log.remat_lines(remat[(2, 2, 2)]),
                                 "remat_control": remat["control"]}
  print("train step", results["train_step_2,2,2"], flush=True)


def check_decode(results):
  """Self-speculative decoding (k = n_future = 3) with sharded params gives one device's tokens."""
  prompts = [[5, 9, 1], [7], [3, 3, 8, 2, 11], [4, 6]]
  out = {}
  for kind in ("parallel", "sequential"):
    cfg = make_config(kind, n_future=3)
    model = build_model(cfg)
    params = random_params(model, seed=3)
    kw = dict(max_new_tokens=10, k=3, eos_id=EOS, pad_id=PAD)
    ref = decode_lib.decode(params, model.args, prompts, **kw)
    for m in ((2, 2, 2), (1, 8, 1)):
      c = make_config(kind, n_future=3, mesh=m)
      mesh = shard_lib.make_mesh(c)
      tx = optim_lib.make_optimizer(c)
      param_sh = train_lib.state_shardings(model, tx, c, mesh).params
      res = decode_lib.decode(jax.device_put(params, param_sh), model.args, prompts, **kw)
      out[f"{kind}/{','.join(map(str, m))}"] = {
          "tokens_equal": bool(np.array_equal(res.tokens, ref.tokens)),
          "lengths_equal": bool(np.array_equal(res.lengths, ref.lengths)),
          "cycles": int(res.cycles.sum()), "cycles_one_device": int(ref.cycles.sum())}
  results["decode"] = out
  print("decode", out, flush=True)


def byte_config(kind, n_future=2, mesh=(1, 1, 1)):
  """The byte tokenizer's vocabulary, 259 ids: 384 rows (model.vocab_multiple = 128)."""
  c = make_config(kind, n_future=n_future, mesh=mesh)
  c.model.vocab_size = 259
  return c


def check_byte_vocab(results):
  """Padded byte vocabulary on (2,2,2): loss and grads (pad logits masked on sharded logits)
  equal one device's; speculative decoding (sequential drafts read the real columns of a
  `tensor`-sharded unembedding) gives one device's tokens."""
  batch = make_batch(2)
  batch["tokens"] = np.random.default_rng(2).integers(0, 259, (8, 16)).astype(np.int32)
  for kind in ("parallel", "sequential"):
    t0 = time.perf_counter()
    cfg1, cfg = byte_config(kind), byte_config(kind, mesh=(2, 2, 2))
    params = random_params(build_model(cfg1), seed=4)
    (rl, rm), rg = loss_and_grads(cfg1, params, batch)[0]
    ((loss, metrics), grads), (param_sh, _) = loss_and_grads(cfg, params, batch,
                                                             shard_lib.make_mesh(cfg))
    name = f"{kind}/2,2,2/vocab259"
    emb = specs(param_sh)["['embed']['embedding']"]
    results["loss_grads"][name] = {
        "loss_cmp": compare(loss, rl), "head_loss_cmp": compare(metrics["head_loss"],
                                                                rm["head_loss"]),
        "grads_cmp": compare(grads, rg),
        "embedding_shape": list(params["embed"]["embedding"].shape),
        "embedding_spec": emb, "seconds": round(time.perf_counter() - t0, 2)}
    print(name, results["loss_grads"][name], flush=True)
  prompts = [[5, 200, 1], [258], [3, 3, 8, 2, 111], [4, 6]]
  cfg1, cfg = byte_config("sequential", 3), byte_config("sequential", 3, mesh=(2, 2, 2))
  model = build_model(cfg1)
  params = random_params(model, seed=5)
  kw = dict(max_new_tokens=10, k=3, eos_id=258, pad_id=256)
  ref = decode_lib.decode(params, model.args, prompts, **kw)
  param_sh = train_lib.state_shardings(model, optim_lib.make_optimizer(cfg), cfg,
                                       shard_lib.make_mesh(cfg)).params
  res = decode_lib.decode(jax.device_put(params, param_sh), model.args, prompts, **kw)
  results.setdefault("decode", {})["sequential/2,2,2/vocab259"] = {
      "tokens_equal": bool(np.array_equal(res.tokens, ref.tokens)),
      "lengths_equal": bool(np.array_equal(res.lengths, ref.lengths)),
      "cycles": int(res.cycles.sum()), "cycles_one_device": int(ref.cycles.sum()),
      "max_token": int(res.tokens.max())}
  print("decode vocab259", results["decode"]["sequential/2,2,2/vocab259"], flush=True)


def _config(mesh=(1, 1, 1), **fields):
  """make_config(mesh=mesh) with fields set by dotted name: _config(**{"train.batch_size": 12})."""
  c = make_config(mesh=mesh)
  c.update_from_flattened_dict(fields)
  return c


def check_errors(results):
  errs = {}
  for name, fn in {
      "mesh_2,2,2_on_4_devices": lambda: shard_lib.make_mesh(
          make_config(mesh=(2, 2, 2)), jax.devices()[:4]),
      "mesh_3,-1,1_on_8_devices": lambda: shard_lib.make_mesh(make_config(mesh=(3, -1, 1))),
      "vocab_61_on_tensor_2": lambda: _shardings(_config(  # unpadded
          (2, 2, 2), **{"model.vocab_size": 61, "model.vocab_multiple": 1})),
      "batch_12_on_8_rows": lambda: shard_lib.check_batch(
          _config((8, 1, 1), **{"train.batch_size": 12}),
          shard_lib.make_mesh(make_config(mesh=(8, 1, 1)))),
      "distributed_bad_mode": lambda: distributed.maybe_initialize_distributed(
          _config(**{"mesh.distributed": "maybe"}).mesh),
  }.items():
    try:
      fn()
      errs[name] = None
    except ValueError as e:
      errs[name] = str(e)
  errs["distributed_off_returns"] = distributed.maybe_initialize_distributed(
      _config(**{"mesh.distributed": "off"}).mesh)
  results["errors"] = errs
  print("errors", errs, flush=True)


def _shardings(c):
  return train_lib.state_shardings(build_model(c), optim_lib.make_optimizer(c), c,
                                   shard_lib.make_mesh(c))


def main(argv):
  out_path, named = argv[1], argv[2:]
  results = {"n_devices": jax.device_count(), "loss_grads": {}, "rtol": RTOL, "atol": ATOL,
             "check_seconds": {}}
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    checks = {"errors": check_errors, "loss_grads": check_loss_grads,
              "loss_grads_one_axis": functools.partial(  # all data, all FSDP
                  check_loss_grads, meshes=((8, 1, 1), (1, 8, 1)), heads_on_tensor=False),
              "train_step": check_train_step, "decode": check_decode,
              "byte_vocab": check_byte_vocab,
              "checkpoint": functools.partial(check_bytes_and_checkpoint, workdir=tmp)}
    for name in named or [c for c in checks if c not in HEAVY_CHECKS]:
      t1 = time.perf_counter()
      checks[name](results)
      results["check_seconds"][name] = round(time.perf_counter() - t1, 1)
  results["seconds"] = round(time.perf_counter() - t0, 1)
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1)
  print(f"done in {results['seconds']}s", flush=True)


if __name__ == "__main__":
  main(sys.argv)
