"""Readers of foreign checkpoints, memory-mapped, one tensor at a time: Meta's model-parallel
*.pth shards and Hugging Face safetensors files. Each has keys(), shape(key) and get(key) (a
float32 numpy array), which is all `layouts.check_tensors` and `layouts.read_params` use.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
from collections.abc import Iterable

import numpy as np

# Meta's model-parallel shards (llama/model.py): column-parallel weights split their rows,
# row-parallel ones and the embedding their columns; norms are replicated.
META_SPLIT = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0,
              "wo": 1, "w2": 1, "tok_embeddings": 1}


def read_json(path: str, what: str) -> dict:
  """A checkpoint's JSON file (params.json, config.json, the safetensors index)."""
  if not os.path.isfile(path):
    raise ValueError(f"--ckpt: no {what} at {path!r}")
  with open(path) as f:
    return json.load(f)


class MetaShards:
  """The *.pth files of a folder in sorted order (consolidated.NN.pth, as Meta's llama loads
  them), memory-mapped; a tensor's model-parallel shards are joined only when it is read."""

  def __init__(self, ckpt: str):
    import torch
    paths = sorted(glob.glob(os.path.join(ckpt, "*.pth")))
    if not paths:
      raise ValueError(f"--ckpt: no *.pth (consolidated.00.pth) in {ckpt!r}")
    self.shards = []
    for path in paths:
      try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
      except pickle.UnpicklingError:
        raise ValueError(f"--ckpt: {path} needs pickled code to load (torch.load with "
                         "weights_only=True refused it); only plain tensor files are read"
                         ) from None
      except RuntimeError as e:
        raise ValueError(f"--ckpt: {path} does not load as a memory-mapped torch file: "
                         f"{str(e).splitlines()[0]}") from None
      if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"--ckpt: {path} is not a dict of tensors")
      if self.shards and set(sd) != set(self.shards[0]):
        odd = sorted(set(sd) ^ set(self.shards[0]))[0]
        raise ValueError(f"--ckpt: {path} and {paths[0]} disagree on tensor {odd!r}")
      self.shards.append(sd)

  def keys(self) -> Iterable[str]:
    return self.shards[0].keys()

  def _dim(self, key: str) -> int | None:
    return META_SPLIT.get(key.rsplit(".", 2)[-2]) if len(self.shards) > 1 else None

  def shape(self, key: str) -> tuple[int, ...]:
    dim, shape = self._dim(key), list(self.shards[0][key].shape)
    if dim is not None and len(shape) > dim:
      shape[dim] = sum(sd[key].shape[dim] for sd in self.shards)
    return tuple(shape)

  def get(self, key: str) -> np.ndarray:
    dim = self._dim(key)
    if dim is None:
      return self.shards[0][key].float().numpy()
    return np.concatenate([sd[key].float().numpy() for sd in self.shards], axis=dim)


class Safetensors:
  """The files model.safetensors.index.json names, else every *.safetensors; memory-mapped.
  bfloat16 tensors (most released Llama checkpoints) are widened to float32 here: safetensors'
  numpy reader refuses them (numpy has no bfloat16)."""

  def __init__(self, ckpt: str):
    from safetensors import safe_open
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.isfile(index):
      names = set(read_json(index, "index")["weight_map"].values())
      files = sorted(os.path.join(ckpt, name) for name in names)
      for path in files:
        if not os.path.isfile(path):
          raise ValueError(f"--ckpt: shard {os.path.basename(path)!r}, named in "
                           f"model.safetensors.index.json, is not in {ckpt!r}")
    else:
      files = sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))
    if not files:
      raise ValueError(f"--ckpt: no *.safetensors in {ckpt!r}")
    self._where, self._path = {}, {}
    for path in files:
      f = safe_open(path, framework="numpy")
      for key in f.keys():
        self._where[key], self._path[key] = f, path

  def keys(self) -> Iterable[str]:
    return self._where.keys()

  def shape(self, key: str) -> tuple[int, ...]:
    return tuple(self._where[key].get_slice(key).get_shape())

  def get(self, key: str) -> np.ndarray:
    if self._where[key].get_slice(key).get_dtype() == "BF16":
      return _bf16_tensor(self._path[key], key)
    return np.asarray(self._where[key].get_tensor(key), np.float32)


def _bf16_tensor(path: str, key: str) -> np.ndarray:
  """A BF16 tensor of a safetensors file as float32, read from the file's own layout (8-byte
  header size, JSON header, raw little-endian data): bfloat16 is float32's upper half."""
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    info = json.loads(f.read(n))[key]
  start, end = info["data_offsets"]
  raw = np.memmap(path, np.uint16, "r", offset=8 + n + start, shape=((end - start) // 2,))
  return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
