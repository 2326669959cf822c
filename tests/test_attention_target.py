"""attention_impl "auto" / "splash" / "cudnn" resolve from the platform of the mesh in context,
not from jax's default backend: an ahead-of-time compile for a TPU topology on a CPU host must
trace the splash kernel. No libtpu needed here: an AbstractMesh names the platform. (The real
XLA:TPU compile of the splash train step is tests/tpu/test_aot_tpu.py, in the TPU venv.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from mtp_jax import attention


def _mesh(platform: str, kind: str):
  return AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor"),
                      abstract_device=AbstractDevice(device_kind=kind, num_cores=1,
                                                     platform=platform))


TPU, GPU = _mesh("tpu", "TPU v5 lite"), _mesh("gpu", "NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("mesh, impl, cached, dtype, want", [
    (None, "auto", False, jnp.bfloat16, "cpu"),  # no mesh: the default backend (cpu here)
    (TPU, "auto", False, jnp.float32, "splash"),
    (TPU, "splash", False, jnp.bfloat16, "splash"),
    (TPU, "auto", True, jnp.float32, "xla"),  # the decode path: splash takes no cache
    (TPU, "cudnn", False, jnp.bfloat16, "xla"),  # a TPU's generic kernel, not the cpu one
    (GPU, "auto", False, jnp.bfloat16, "cudnn"),
    (GPU, "splash", False, jnp.bfloat16, "xla"),
])
def test_resolve_reads_the_mesh_platform(mesh, impl, cached, dtype, want):
  assert jax.default_backend() == "cpu"
  if mesh is None:
    got = attention.resolve(impl, cached=cached, segments=False, dtype=dtype)
  else:
    with use_abstract_mesh(mesh):
      assert attention.target_platform() == mesh.abstract_device.platform
      got = attention.resolve(impl, cached=cached, segments=False, dtype=dtype)
  assert got == want
  assert attention.target_platform() == "cpu"  # the context is gone again


def test_traced_model_attention_uses_splash_for_a_tpu_mesh(make_config, make_model):
  """The whole forward, traced (not lowered: that needs libtpu) under a TPU mesh, calls the
  Pallas kernel; under no mesh on this CPU it does not."""
  c = make_config()
  c.model.attention_impl = "auto"
  c.data.seq_len = c.model.max_len = 128  # the compiled kernel's blocks are 128 long
  model, params = make_model(c)
  tokens = np.zeros((2, c.data.seq_len), np.int32)
  f = jax.jit(lambda p, t: model.apply({"params": p}, t))
  with use_abstract_mesh(TPU):
    on_tpu = str(f.trace(params, tokens).jaxpr)
  on_cpu = str(f.trace(params, tokens).jaxpr)
  assert "pallas_call" in on_tpu
  assert "pallas_call" not in on_cpu
