"""model.cpu_matmul / backends.cpu.gemm: MKL's sgemm through an XLA FFI handler gives XLA's dot's
values and gradients (every split the handler makes: by rows, by columns, a batch under vmap,
transposed operands), takes exactly the products it should, and a train step's loss and
gradients match XLA's."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from mtp_jax import layers
from mtp_jax.config import validation
from mtp_jax.backends.cpu import gemm as cpu_gemm
from mtp_jax.model import build_model, init_params


@pytest.fixture(scope="module", autouse=True)
def mkl():
  """The handler, built here; under CI (make test installs torch's CPU wheel and a C++ compiler
  is at hand) its absence is a failure, not a skip."""
  why = cpu_gemm.unavailable_reason()
  if why is not None:
    if os.environ.get("CI"):
      pytest.fail(f"cpu_gemm unavailable under CI: {why}")
    pytest.skip(why)


def _rand(*shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5 * float(
      np.abs(np.asarray(b)).max()))


# (m, k, n): split by rows (m >= n), by columns (n > m), sizes off the 16-row blocks, one row
@pytest.mark.parametrize("m,k,n", [(300, 70, 50), (20, 33, 500), (1, 8, 3), (257, 256, 771)])
def test_matmul_values_and_gradients(m, k, n):
  x, w, dy = _rand(m, k, seed=1), _rand(k, n, seed=2), _rand(m, n, seed=3)
  _close(jax.jit(cpu_gemm.matmul)(x, w), x @ w)
  # the VJP's two products: dy w^T (w transposed) and x^T dy (x transposed)
  got = jax.jit(jax.vjp(cpu_gemm.matmul, x, w)[1])(dy)
  _close(got[0], dy @ w.T)
  _close(got[1], x.T @ dy)


def test_matmul_under_vmap():
  """Batched weights with a shared input (nn.vmap'd parallel heads): a loop of GEMMs."""
  x, w_NxKxN = _rand(40, 24, seed=1), _rand(3, 24, 56, seed=2)
  got = jax.jit(jax.vmap(cpu_gemm.matmul, in_axes=(None, 0)))(x, w_NxKxN)
  _close(got, jnp.einsum("mk,nkj->nmj", x, w_NxKxN))
  g = jax.grad(lambda w: jnp.sum(jnp.sin(jax.vmap(cpu_gemm.matmul, (None, 0))(x, w))))(w_NxKxN)
  _close(g, jax.grad(lambda w: jnp.sum(jnp.sin(jnp.einsum("mk,nkj->nmj", x, w))))(w_NxKxN))


def _custom_calls(fn, *args) -> int:
  return jax.jit(fn).lower(*args).as_text().count(cpu_gemm.TARGET)


def test_dot_general_takes_only_float32_products_of_many_rows():
  dn_dense = (((2,), (0,)), ((), ()))  # [B, S, D] x [D, N]: nn.Dense
  x, w = _rand(2, 200, 16), _rand(16, 8)
  dg = cpu_gemm.dot_general
  _close(jax.jit(lambda x, w: dg(x, w, dn_dense))(x, w), x @ w)
  assert _custom_calls(lambda x, w: dg(x, w, dn_dense), x, w) == 1
  # DenseGeneral over two axes ([T, H, E] x [H, E, D]: the attention output projection)
  x3, w3 = _rand(256, 4, 8), _rand(4, 8, 16)
  dn_two = (((1, 2), (0, 1)), ((), ()))
  _close(jax.jit(lambda x, w: dg(x, w, dn_two))(x3, w3), jnp.einsum("the,hed->td", x3, w3))
  assert _custom_calls(lambda x, w: dg(x, w, dn_two), x3, w3) == 1
  # left to XLA: fewer rows than MIN_ROWS (a decoding step), bfloat16, a batch axis, a
  # contraction that is not trailing-against-leading
  few = _rand(cpu_gemm.MIN_ROWS - 1, 16)
  assert _custom_calls(lambda x, w: dg(x, w, (((1,), (0,)), ((), ()))), few, w) == 0
  bf = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  assert _custom_calls(lambda x, w: dg(x, w, dn_dense), *bf) == 0
  xb, wb = _rand(2, 300, 16), _rand(2, 16, 8)
  assert _custom_calls(lambda x, w: dg(x, w, (((2,), (1,)), ((0,), (0,)))), xb, wb) == 0
  xt = _rand(16, 300)
  assert _custom_calls(lambda x, w: dg(x, w, (((0,), (0,)), ((), ()))), xt, w) == 0


def _config(make_config, kind, cpu_matmul):
  c = make_config(kind, 2)
  c.model.cpu_matmul = cpu_matmul
  c.data.seq_len, c.model.max_len, c.train.batch_size = 64, 64, 4  # 256 rows: MKL takes them
  return c


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parallel", "projection", "sequential"])
def test_loss_and_gradients_match_xla(make_config, kind):
  """The model's loss and every gradient with MKL's matmuls (trunk, the head kind's own dense
  layers, the logits) against XLA's dot; "auto" resolves to MKL on this one Intel CPU device, to
  XLA under a multi-device mesh (and on a CPU not Intel's)."""
  from mtp_jax import loss as loss_lib
  models = {m: build_model(_config(make_config, kind, m)) for m in ("xla", "mkl")}
  assert layers.dot_general(models["mkl"].args) is cpu_gemm.dot_general
  auto = build_model(_config(make_config, kind, "auto")).args
  assert layers.dot_general(auto) is (
      cpu_gemm.dot_general if cpu_gemm.intel_cpu() else jax.lax.dot_general)
  mesh = AbstractMesh((2, 1, 1), ("data", "fsdp", "tensor"), abstract_device=AbstractDevice(
      device_kind="cpu", num_cores=1, platform="cpu"))
  with use_abstract_mesh(mesh):
    assert layers.dot_general(auto) is jax.lax.dot_general
  dots_remat = _config(make_config, kind, "auto")
  dots_remat.model.remat_policy = "dots_saveable"  # would recompute the custom call: XLA's dot
  assert layers.dot_general(build_model(dots_remat).args) is jax.lax.dot_general
  c = _config(make_config, kind, "xla")
  params = jax.jit(lambda k: init_params(models["xla"], k))(jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 64), 0, c.model.vocab_size)
  batch = {"tokens": tokens}
  out = {}
  for m, model in models.items():
    fn = jax.jit(jax.value_and_grad(
        lambda p, model=model: loss_lib.model_loss(p, model, c, batch)[0]))
    out[m] = fn(params)
    if m == "mkl":
      assert fn.lower(params).as_text().count(cpu_gemm.TARGET) > 0
  np.testing.assert_allclose(out["mkl"][0], out["xla"][0], rtol=1e-5)
  jax.tree.map(lambda a, b: _close(a, b), out["mkl"][1], out["xla"][1])


def test_validation_names_the_field(make_config, monkeypatch):
  c = make_config("parallel", 2)
  c.model.cpu_matmul = "openblas"
  with pytest.raises(ValueError, match=r"model\.cpu_matmul.*allowed: 'auto', 'xla', 'mkl'"):
    validation.validate(c)
  monkeypatch.setattr(cpu_gemm, "available", lambda: False)
  monkeypatch.setattr(cpu_gemm, "unavailable_reason", lambda: "no torch here")
  c.model.cpu_matmul = "mkl"
  with pytest.raises(ValueError, match=r"model\.cpu_matmul.*no torch here"):
    validation.validate(c)
  c.model.cpu_matmul = "auto"
  validation.validate(c)  # auto falls back to XLA's dot
  assert layers.dot_general(build_model(c).args) is jax.lax.dot_general


def test_profiles_class_it_as_a_library_dot():
  """experiments/hlo_profile puts the handler's custom call with the dots (profile_train's
  `dot (library)`), not with the elementwise fusions."""
  from experiments import hlo_profile
  x, w = _rand(300, 16), _rand(16, 8)
  text = jax.jit(cpu_gemm.matmul).lower(x, w).compile().as_text()
  comps = hlo_profile.computations(text)
  ops = [op for lines in comps.values() for op in hlo_profile.classify(lines, comps).values()
         if op["opcode"] == "custom-call"]
  assert [(op["class"], op["library"]) for op in ops] == [("dot", True)]


@pytest.mark.slow
def test_remat_gives_the_same_gradients(make_config):
  """Under nn.remat (full, and a dots-saving policy asked for with "mkl") the custom VJP is
  recomputed, not changed."""
  from mtp_jax import loss as loss_lib
  grads = {}
  batch = {"tokens": jax.random.randint(jax.random.PRNGKey(1), (4, 64), 0, 61)}
  for policy in ("none", "full", "dots_saveable"):
    c = _config(make_config, "parallel", "mkl")
    c.model.remat_policy = policy
    model = build_model(c)
    params = jax.jit(lambda k, model=model: init_params(model, k))(jax.random.PRNGKey(0))
    grads[policy] = jax.jit(jax.grad(
        lambda p, model=model, c=c: loss_lib.model_loss(p, model, c, batch)[0]))(params)
  for policy in ("full", "dots_saveable"):
    jax.tree.map(_close, grads[policy], grads["none"])
