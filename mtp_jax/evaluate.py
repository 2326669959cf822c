"""`python -m mtp_jax.evaluate`: HumanEval / MBPP pass@k. The flags and the code are in
mtp_jax.evaluation.passk; this entry point applies the CPU defaults before JAX starts."""

if __name__ == "__main__":
  import sys

  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

  from mtp_jax.evaluation import passk
  sys.exit(passk.main())
