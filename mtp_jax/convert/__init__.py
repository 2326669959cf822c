"""Checkpoint interop: import Meta's multi-token-prediction weights and DeepSeek-V3-style MTP
layers on a dense Llama, export trunk + head 1 (the next-token model) as a Hugging Face Llama.

  python -m mtp_jax.convert meta --ckpt DIR --out WORKDIR [--tokenizer PATH]
  python -m mtp_jax.convert deepseek --ckpt DIR --out WORKDIR [--tokenizer PATH]
  python -m mtp_jax.convert to-hf --workdir WORKDIR --out DIR
  python -m mtp_jax.convert from-hf --ckpt DIR --out WORKDIR --n_future 4 --heads parallel

An imported WORKDIR is what `python -m mtp_jax.generate --workdir WORKDIR` reads: config.json and
a params-only orbax checkpoint at step 0. The package in three parts:

  readers   foreign checkpoints, memory-mapped: Meta's *.pth shards (MetaShards), safetensors
  layouts   `Entry` tables (foreign tensor -> our parameter and slot), their checks and filling
  workdir   import_meta, import_deepseek, export_hf and the workdir they write
  from_hf   import_hf: a plain HF Llama plus new heads (fine-tune them with train.init_from)
  command   the command line (`main`)
"""

from mtp_jax.convert.command import main
from mtp_jax.convert.from_hf import import_hf
from mtp_jax.convert.layouts import (BLOCK, Entry, block_entries, check_tensors,
                                     deepseek_entries, llama_entries, meta_entries, param_shapes,
                                     read_params, real_shape, to_ours, to_torch, torch_shape,
                                     unpad)
from mtp_jax.convert.readers import META_SPLIT, MetaShards, Safetensors
from mtp_jax.convert.workdir import (check_out, export_hf, import_deepseek, import_meta,
                                     prepare_config, write_workdir)

__all__ = ["BLOCK", "META_SPLIT", "Entry", "MetaShards", "Safetensors", "block_entries",
           "check_out", "check_tensors", "deepseek_entries", "export_hf", "import_deepseek",
           "import_hf", "import_meta", "llama_entries", "main", "meta_entries", "param_shapes",
           "prepare_config", "read_params", "real_shape", "to_ours", "to_torch", "torch_shape",
           "unpad", "write_workdir"]
