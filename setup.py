from setuptools import find_packages, setup

setup(
    name="mtp_jax",
    version="0.1.0",
    description="Multi-token prediction language models in JAX/Flax: parallel, projection and "
    "sequential heads, O(V+d) loss, self-speculative decoding.",
    packages=find_packages(include=["mtp_jax", "mtp_jax.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10,<0.11",
        "flax>=0.12,<0.13",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "grain>=0.2.12",
        "tensorflow-datasets>=4.9.9",
        "array-record>=0.8",
        "ml-collections>=1.0",
        "absl-py",
        "numpy",
        "sentencepiece>=0.2",
        "tensorboardX>=2.6",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist", "chex>=0.1.89"],
    },
)
