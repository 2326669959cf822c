"""The CPU backend: everything that exists for XLA:CPU speed (docs/cpu_speed.md), which a reader
of the model can skip. The core reaches it through `mtp_jax.backends.current()` only.

    ops.py       the trace-time CPU choices behind the seam (dot routing, fused projections,
                 tables written once, the one-token cache write, unroll and batch-slice policy)
    fused.py     fused_dense (q|k|v, w1|w3 as one matmul) and silu_gate's one-pass backward
    attention.py the `cpu` attention kernel (model.attention_impl)
    gemm.py      model.cpu_matmul = mkl: MKL's sgemm from an XLA FFI handler (csrc/cpu_gemm.cc)
    runtime.py   the process defaults an entry point applies before JAX starts (XLA flag, huge
                 pages, mimalloc by one re-exec) and decoding's per-batch compile options
    cpuinfo.py   /proc/cpuinfo: vendor, family, model, model name (`mtp_jax.hostinfo`'s)
"""
