"""The MTP transformer: causality by gradients, packed documents, scan = unrolled, remat = plain,
jit = eager, matched parameter counts, sequential-head variants, and the KV-cache path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.heads import KINDS
from mtp_jax.model import (build_model, init_decode_cache, init_params, param_count,
                           trunk_states)

S_DEP = 8  # sequence length of the dependency tests
SEGMENTS_DEP = np.array([[1, 1, 1, 2, 2, 2, 2, 0]], np.int32)  # doc 1: 0-2, doc 2: 3-6, pad: 7
DOC1, DOC2 = np.arange(0, 3), np.arange(3, 7)


def _shapes(params):
  return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), params)


@pytest.fixture(scope="module", params=tuple(KINDS))
def dependencies(request, make_config, make_model):
  """(kind, plain, packed): dep[i, t, s] = |d <h[i, 0, t], r> / d emb[0, s]|_1 for a fixed random
  direction r, without and with the segment ids above; exactly 0 where h[i, t] cannot see s."""
  kind = request.param
  model, params = make_model(make_config(kind, 3))
  D, N = model.args.d_model, model.args.n_future
  k_emb, k_dir = jax.random.split(jax.random.PRNGKey(7))
  emb_1xSxD = jax.random.normal(k_emb, (1, S_DEP, D))
  r_Nx1xSxD = jax.random.normal(k_dir, (N, 1, S_DEP, D))
  tokens = jnp.zeros((1, S_DEP), jnp.int32)

  def dep(params, emb, segments):
    def f(emb):
      h_NxBxSxD, _ = model.apply({"params": params}, tokens, segments, embeddings_BxSxD=emb)
      return jnp.sum(h_NxBxSxD * r_Nx1xSxD, axis=-1)
    jac_Nx1xSx1xSxD = jax.jacrev(f)(emb)
    return jnp.abs(jac_Nx1xSx1xSxD).sum(-1)[:, 0, :, 0, :]

  both = jax.jit(lambda p, e, s: (dep(p, e, None), dep(p, e, s)))
  plain, packed = both(params, emb_1xSxD, SEGMENTS_DEP)
  return kind, np.asarray(plain), np.asarray(packed)


def test_causality_by_gradients(dependencies):
  """Parallel and projection heads: h[i, t] sees embeddings at s <= t, none after. Sequential
  depth i (head i + 1) sees s <= t + i (teacher-forced x_{t+1..t+i}) and nothing beyond."""
  kind, dep, _ = dependencies
  N, S, _ = dep.shape
  for i in range(N):
    reach = i if kind == "sequential" else 0
    for t in range(S):
      last = min(t + reach, S - 1)
      assert not np.any(dep[i, t, last + 1:]), (i, t, dep[i, t])
      assert np.all(dep[i, t, :last + 1] > 0), (i, t, dep[i, t])
      if kind == "sequential" and i >= 1 and t + i < S:
        assert dep[i, t, t + i] > 0  # depth i reads the true token x_{t+i}


@pytest.mark.slow
def test_packed_documents_do_not_see_each_other(dependencies):
  """With segment ids, no output in document 2 depends on document 1 (trunk: head 1 is the trunk
  for projection and sequential heads; head blocks and depths: the other heads)."""
  kind, _, dep = dependencies
  N = dep.shape[0]
  assert not np.any(dep[:, DOC2][:, :, DOC1])
  for i in range(N):
    reach = i if kind == "sequential" else 0
    for t in DOC1:
      if t + reach <= DOC1[-1]:  # its inputs all lie in document 1
        assert not np.any(dep[i, t, DOC1[-1] + 1:])
    # ... while attention inside document 2 still works.
    assert np.all(dep[i, DOC2[-1], DOC2] > 0)


@pytest.mark.parametrize("kind", ["parallel", "projection"])
def test_scan_equals_unrolled(make_config, make_model, kind):
  c = make_config(kind, 2)
  c.model.scan_unroll = 1  # the scanned loop (auto would unroll it on this one CPU device)
  model, params = make_model(c)
  c.model.scan_layers = False
  unrolled = build_model(c)
  n_trunk = model.args.n_trunk
  assert n_trunk >= 2
  stacked = params["trunk"]["layers"]
  params_unrolled = dict(params)
  params_unrolled["trunk"] = {f"layers_{i}": jax.tree.map(lambda x, i=i: x[i], stacked)
                              for i in range(n_trunk)}
  expected = jax.eval_shape(lambda: init_params(unrolled, jax.random.PRNGKey(0)))
  assert _shapes(params_unrolled) == _shapes(expected)

  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, c.model.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  cache = init_decode_cache(model.args, 2, 16)

  @jax.jit
  def run(p_scan, p_unrolled):
    out = []
    for m, p in ((model, p_scan), (unrolled, p_unrolled)):
      h, _ = m.apply({"params": p}, tokens)
      h_cached, new_cache = m.apply({"params": p}, tokens, None, positions, cache)
      out.append((h, h_cached, new_cache))
    return out

  (h, h_c, cache_s), (h_u, h_cu, cache_u) = run(params, params_unrolled)
  np.testing.assert_allclose(h_u, h, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(h_cu, h_c, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
               cache_u, cache_s)


@pytest.mark.slow
def test_scan_unroll_same_maths_and_auto_by_target(make_config, make_model):
  """model.scan_unroll (layers per iteration of the scanned trunk; params stacked either way):
  the loop (1), a partial unroll with a remainder (2 of 3 layers) and auto (0: every layer on
  one CPU device) give the same outputs and gradients; auto compiles without the trunk's loops here,
  and resolves to the loop under a multi-device or TPU mesh."""
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  from mtp_jax.model import trunk_unroll
  models = {}
  for unroll in (1, 2, 0):
    c = make_config("parallel", 1)
    c.model.scan_unroll = unroll
    models[unroll], params = make_model(c)
  args = models[0].args
  assert args.n_trunk == 3 and trunk_unroll(args) == 3
  for shape, platform in (((2, 1, 1), "cpu"), ((1, 1, 1), "tpu")):
    mesh = AbstractMesh(shape, ("data", "fsdp", "tensor"), abstract_device=AbstractDevice(
        device_kind=platform, num_cores=1, platform=platform))
    with use_abstract_mesh(mesh):
      assert trunk_unroll(args) == 1, (shape, platform)
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 16), 0, 61)
  r = jax.random.normal(jax.random.PRNGKey(5), (1, 2, 16, 32))

  compiled = {u: jax.jit(jax.value_and_grad(
      lambda p, m=m: jnp.sum(m.apply({"params": p}, tokens)[0] * r))).lower(params).compile()
              for u, m in models.items()}  # compiled once: run, and read for its loops
  want_loss, want = compiled[1](params)
  for unroll in (2, 0):
    loss, got = compiled[unroll](params)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), got, want)
  # + the embedding's scatter loop in each
  loops = {u: compiled[u].as_text().count(" while(") for u in (1, 0)}
  assert loops[1] == loops[0] + 2, loops  # the trunk's forward and backward loops


@pytest.mark.slow
def test_fused_projections_same_params_and_maths(make_config):
  """model.fuse_projections: q|k|v (with Qwen2's biases and Qwen3's q/k norms) and w1|w3 as one
  matmul each ("on") against a DenseGeneral per projection ("off"): the same parameter tree and
  initial values (the real initialiser), outputs, gradients and cached decoding; "on" compiles
  fewer dots; auto fuses on this one CPU device, not under a multi-device or TPU mesh."""
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  from mtp_jax.layers import fuse_projections
  models = {}
  for mode in ("off", "on", "auto"):
    c = make_config("parallel", 2)
    c.model.update(fuse_projections=mode, qkv_bias=True, qk_norm=True)
    models[mode] = build_model(c)
  assert fuse_projections(models["auto"].args)
  for shape, platform in (((2, 1, 1), "cpu"), ((1, 1, 1), "tpu")):
    mesh = AbstractMesh(shape, ("data", "fsdp", "tensor"), abstract_device=AbstractDevice(
        device_kind=platform, num_cores=1, platform=platform))
    with use_abstract_mesh(mesh):
      assert not fuse_projections(models["auto"].args), (shape, platform)
  init = {m: jax.jit(lambda k, m=m: init_params(models[m], k))(jax.random.PRNGKey(0))
          for m in ("off", "on")}
  assert _shapes(init["on"]) == _shapes(init["off"])
  jax.tree.map(np.testing.assert_array_equal, init["on"], init["off"])
  # biases are zero at init: perturb every leaf so that each one shows in the outputs
  leaves, treedef = jax.tree.flatten(init["off"])
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  params = treedef.unflatten([x + 0.1 * jax.random.normal(k, x.shape)
                              for x, k in zip(leaves, keys)])
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, 61)
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  r = jax.random.normal(jax.random.PRNGKey(3), (2, 2, 12, 32))

  def run(p, m):
    loss, g = jax.value_and_grad(lambda p: jnp.sum(m.apply({"params": p}, tokens)[0] * r))(p)
    h_cached, cache = m.apply({"params": p}, tokens, None, positions,
                              init_decode_cache(m.args, 2, 16))
    return loss, g, h_cached, cache
  compiled = {m: jax.jit(run, static_argnums=1).lower(params, models[m]).compile()
              for m in ("off", "on")}
  want = compiled["off"](params)
  got = compiled["on"](params)  # float sums in another order: tolerance scaled to each leaf
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-4, atol=2e-6 * max(1.0, float(np.abs(b).max()))), got, want)
  dots = {m: compiled[m].as_text().count(" dot(") for m in compiled}
  assert dots["on"] < dots["off"], dots


@pytest.mark.slow  # forward and backward, twice, per kind (4 to 9 s)
@pytest.mark.parametrize("kind", ["parallel", "sequential"])
def test_remat_equals_no_remat(make_config, make_model, kind):
  """remat_policy 'full' and 'dots_saveable' against 'none': same parameter tree, same outputs,
  same gradients (trunk blocks, parallel head blocks, sequential depth blocks)."""
  models, params = {}, None
  for policy in ("none", "full", "dots_saveable"):
    c = make_config(kind, 3)
    c.model.remat_policy = policy
    models[policy], p = make_model(c)
    params = p if params is None else params
    assert _shapes(p) == _shapes(params)  # checkpoints load across policies
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, 61)
  segments = jnp.asarray([[1] * 16, [1] * 9 + [2] * 7])
  r = jax.random.normal(jax.random.PRNGKey(3), (3, 2, 16, 32))

  @jax.jit
  def run(params):
    out = {}
    for policy, m in models.items():
      def f(p, m=m):
        h_NxBxSxD = m.apply({"params": p}, tokens, segments)[0]
        return jnp.sum(h_NxBxSxD * r), h_NxBxSxD
      out[policy] = jax.value_and_grad(f, has_aux=True)(params)
    return out

  out = run(params)
  (_, h_ref), grads_ref = out["none"]
  for policy in ("full", "dots_saveable"):
    (_, h), grads = out[policy]
    np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-6, err_msg=policy)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 grads, grads_ref)


@pytest.mark.parametrize("kind", tuple(KINDS))
def test_heads_on_given_trunk_states_equal_the_whole_model(make_config, make_model, kind):
  """trunk_states once, then heads on it (heads-only training on a frozen trunk) = the model."""
  model, params = make_model(make_config(kind, 3))
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 8), 0, model.args.vocab_size)
  seg = jnp.asarray([[1] * 8, [1] * 3 + [2] * 5])
  f = jax.jit(lambda p, t: (
      model.apply({"params": p}, t, seg)[0],
      model.apply({"params": p}, t, seg, trunk_states_BxSxD=trunk_states(p, model.args, t,
                                                                           seg))[0]))
  whole, given = f(params, tokens)
  np.testing.assert_allclose(given, whole, rtol=1e-6, atol=1e-6)
  z = trunk_states(params, model.args, tokens, seg)
  assert not np.allclose(model.apply({"params": params}, tokens, seg,
                                     trunk_states_BxSxD=z + 0.1)[0], whole, atol=1e-3)


@pytest.mark.slow
def test_jit_equals_eager(make_config, make_model):
  # Projection heads: the cheapest kind to run op by op (eager parallel heads cost seconds more).
  c = make_config("projection", 2)
  model, params = make_model(c)
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 8), 0, c.model.vocab_size)
  f = lambda p, t: model.apply({"params": p}, t, jnp.asarray([[1] * 8, [1] * 3 + [2] * 5]))[0]
  np.testing.assert_allclose(jax.jit(f)(params, tokens), f(params, tokens), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.slow
def test_parallel_heads_scan_equals_vmap(make_config, make_model):
  """`heads.parallel_stack`: one head block at a time (scan) is the same maths and the same
  parameter layout as all at once (vmap): outputs, gradients and decode caches."""
  c = make_config("parallel", 3)
  vmapped, params = make_model(c)
  c.model.heads.parallel_stack = "scan"
  scanned = build_model(c)
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 8), 0, c.model.vocab_size)
  loss = lambda m: lambda p: jnp.sum(m.apply({"params": p}, tokens)[0] ** 2)
  ref = jax.jit(jax.value_and_grad(loss(vmapped)))(params)
  out = jax.jit(jax.value_and_grad(loss(scanned)))(params)
  # Summation order differs (f32, values up to ~60): tolerances for that, not for a bug.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-4), ref, out)
  cache = init_decode_cache(vmapped.args, 2, 8)
  pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
  a = vmapped.apply({"params": params}, tokens, positions_BxS=pos, cache=cache)
  b = scanned.apply({"params": params}, tokens, positions_BxS=pos, cache=cache)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)


def _abstract_params(config):
  model = build_model(config)
  return model, jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))


def test_parallel_heads_match_parameters(make_config):
  """Gloeckle et al. §3: the extra heads take their blocks from the trunk."""
  counts = {}
  for n in (1, 2, 4, 6):
    c = make_config("parallel", n)
    c.model.n_layers = 6
    model, params = _abstract_params(c)
    counts[n] = param_count(params)
    blocks = params["heads"]["blocks"]["ffn_norm"]["scale"].shape[0]
    trunk = params["trunk"]["layers"]["ffn_norm"]["scale"].shape[0] if model.args.n_trunk else 0
    assert (trunk, blocks) == (6 - n, n)
  assert len(set(counts.values())) == 1, counts
  # Projection heads are extra parameters on top of the next-token model, by design.
  _, p1 = _abstract_params(make_config("projection", 1))
  _, p4 = _abstract_params(make_config("projection", 4))
  assert param_count(p4) > param_count(p1)


@pytest.mark.slow
def test_init_params_real_initialiser(make_config):
  """The real initialiser (other tests use conftest.random_params): norms start at one, the
  embedding at std 0.02, and the tree is what eval_shape promises."""
  model = build_model(make_config("projection", 1))
  params = jax.jit(lambda k: init_params(model, k))(jax.random.PRNGKey(0))
  assert _shapes(params) == _shapes(
      jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0))))
  np.testing.assert_array_equal(params["norm"], 1.0)
  np.testing.assert_array_equal(params["trunk"]["layers"]["attention_norm"]["scale"], 1.0)
  assert 0.015 < float(jnp.std(params["embed"]["embedding"])) < 0.025


def _seq_config(make_config, concat="emb_first", trunk_state="post_norm",
                output_norm="per_module"):
  c = make_config("sequential", 3)
  h = c.model.heads
  h.seq_preset, h.seq_concat, h.seq_trunk_state, h.seq_output_norm = (
      "", concat, trunk_state, output_norm)
  return c


@pytest.mark.slow
def test_sequential_variants_change_what_they_should(make_config, make_model):
  base_model, params = make_model(_seq_config(make_config))
  variants = {
      "hidden_first": _seq_config(make_config, concat="hidden_first"),
      "pre_norm": _seq_config(make_config, trunk_state="pre_norm"),
      "shared": _seq_config(make_config, output_norm="shared"),
  }
  models = {name: build_model(c) for name, c in variants.items()}
  depth_params = params["heads"]["depths"]
  assert "shared_head_norm" in depth_params  # DeepSeek's per-module `shared_head.norm`
  shared_shapes = jax.eval_shape(lambda: init_params(models["shared"], jax.random.PRNGKey(0)))
  assert "shared_head_norm" not in shared_shapes["heads"]["depths"]  # MaxText: the main norm
  params_shared = {**params, "heads": {"depths": {
      k: v for k, v in depth_params.items() if k != "shared_head_norm"}}}
  assert _shapes(params_shared) == _shapes(shared_shapes)
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 12), 0, 61)

  @jax.jit
  def run(params, params_shared):
    out = {"base": base_model.apply({"params": params}, tokens)[0]}
    for name, m in models.items():
      out[name] = m.apply({"params": params_shared if name == "shared" else params}, tokens)[0]
    return out

  out = run(params, params_shared)
  for name in variants:
    np.testing.assert_allclose(out[name][0], out["base"][0], rtol=1e-6, atol=1e-6,
                               err_msg=name)  # head 1 is the trunk: unchanged
    for depth in (1, 2):
      diff = float(jnp.max(jnp.abs(out[name][depth] - out["base"][depth])))
      assert diff > 1e-2, (name, depth, diff)


@pytest.mark.slow
@pytest.mark.parametrize("kind", tuple(KINDS))
def test_kv_cache_matches_full_forward(make_config, make_model, kind):
  """One cached pass, and a prefix then the rest with positions continuing, give the no-cache
  h. Sequential depths read x_{t+k}, which the prefix pass cannot know near its end, so after a
  split only head 1, and depth k at prefix positions t < P - k, are comparable."""
  c = make_config(kind, 3)
  model, params = make_model(c)
  B, S, P, L = 2, 10, 4, 16  # L > S: slots never written stay masked
  tokens = jax.random.randint(jax.random.PRNGKey(6), (B, S), 0, c.model.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(S), (B, S))
  cache = init_decode_cache(model.args, B, L)

  @jax.jit
  def run(params):
    apply = lambda *a: model.apply({"params": params}, *a)
    h_ref, _ = apply(tokens)
    h_one, cache_one = apply(tokens, None, positions, cache)
    h_a, cache_a = apply(tokens[:, :P], None, positions[:, :P], cache)
    h_b, cache_b = apply(tokens[:, P:], None, positions[:, P:], cache_a)
    return h_ref, h_one, jnp.concatenate([h_a, h_b], axis=2), cache_one, cache_b

  h_ref, h_one, h_split, cache_one, cache_split = run(params)
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=2e-5)
  close(h_one, h_ref)
  if kind == "sequential":
    close(h_split[0], h_ref[0])
    for k in range(1, 3):
      close(h_split[k][:, :P - k], h_ref[k][:, :P - k])
    jax.tree.map(close, cache_split["trunk"], cache_one["trunk"])
  else:
    close(h_split, h_ref)
    jax.tree.map(close, cache_split, cache_one)
