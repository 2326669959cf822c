"""The first CPU of /proc/cpuinfo, for the CPU backend's rules: `mtp_jax.hostinfo`'s, which
sits beneath the backends (a run's host description reads it there)."""

from mtp_jax.hostinfo import cpu_ids, cpu_model_name, cpuinfo  # noqa: F401
