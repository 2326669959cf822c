"""Add multi-token-prediction heads to a model in a GGUF file (llama.cpp's format): the tensors
are dequantized to float32, the tokenizer is rebuilt from the file's metadata, and the rest is
`from-hf` (head 1 is the GGUF model; heads 2..n are new).

  python -m mtp_jax.convert from-gguf --gguf FILE --out WORKDIR --n_future 4 \\
      --heads parallel|projection|sequential [--init_heads copy|random] [--dtype bfloat16]

Readers, not hand-written tables: the file is opened with llama.cpp's own `gguf` package
(`GGUFReader`: the header, metadata and tensor types are checked here first, so a file that
cannot be imported is one `error:` line before anything is read in full or written); then
transformers' GGUF loading (`load_gguf_checkpoint`, the code behind `from_pretrained(...,
gguf_file=...)`) maps llama.cpp's tensor names to Hugging Face's, undoes llama.cpp's
permutation of the q/k rows and dequantizes with `gguf.dequantize`; the tokenizer is
transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(folder, gguf_file=...)`), saved as
tokenizer.json, tokenizer_config.json and chat_template.jinja into the workdir. So head 1's
logits, greedy tokens and token ids are those of `AutoModelForCausalLM.from_pretrained(folder,
gguf_file=...)` and its tokenizer (tests/test_gguf.py, tests/integration/test_smollm2.py).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import ml_collections
import numpy as np

from mtp_jax.convert import families, from_hf
from mtp_jax.convert.workdir import check_out

# llama.cpp's general.architecture values accepted: blocks mtp_jax computes (families.py) and
# tests here read.
ARCHITECTURES = ("llama",)


class TensorDict:
  """A reader (keys, shape, get) over float32 arrays already in memory, named as HF names them."""

  def __init__(self, tensors: dict[str, np.ndarray]):
    self._t = tensors

  def keys(self):
    return self._t.keys()

  def shape(self, key: str) -> tuple[int, ...]:
    return tuple(self._t[key].shape)

  def get(self, key: str) -> np.ndarray:
    return np.asarray(self._t[key], np.float32)


def _field(reader, key: str):
  f = reader.fields.get(key)
  if f is None:
    return None
  return f.contents()


def open_gguf(path: str):
  """gguf.GGUFReader on `path`, with one-line errors for a missing, truncated or foreign file,
  another architecture and a tensor type `gguf` cannot dequantize."""
  try:
    import gguf
  except ImportError:
    raise ValueError("--gguf: reading GGUF files needs the gguf package (pip install -e "
                     "'.[convert]')") from None
  if not os.path.isfile(path):
    raise ValueError(f"--gguf: no file at {path!r}")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # truncated or not GGUF: ValueError, IndexError, struct errors...
    raise ValueError(f"--gguf: {path} is not a readable GGUF file ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else 'no detail'}); truncated or not "
                     "GGUF?") from None
  arch = _field(reader, "general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(f"--gguf: general.architecture {arch!r}; from-gguf reads "
                     + ", ".join(map(repr, ARCHITECTURES)))
  readable = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
  readable |= set(getattr(gguf.quants, "_type_traits", {}))
  for t in reader.tensors:
    if t.tensor_type not in readable:
      raise ValueError(f"--gguf: tensor {t.name!r} is {t.tensor_type.name}, which the gguf "
                       f"package {getattr(gguf, '__version__', '')} cannot dequantize; readable: "
                       + ", ".join(sorted(q.name for q in readable)))
  return reader


@contextlib.contextmanager
def one_reader(path: str, reader):
  """While open, `gguf.GGUFReader(path)` returns `reader` (built by `open_gguf`). transformers
  opens the file anew for each of its reads (the config, the tensors, the tokenizer), and the
  gguf package builds a reader by parsing every metadata entry one by one: ~4 s each for
  SmolLM2's 49,152-token vocabulary and 48,900 merges. Any other path opens as before."""
  import gguf
  made = gguf.GGUFReader
  mine = os.path.realpath(path)

  def reader_for(p, *args, **kwargs):
    if not args and not kwargs and os.path.realpath(p) == mine:
      return reader
    return made(p, *args, **kwargs)

  gguf.GGUFReader = reader_for
  try:
    yield reader
  finally:
    gguf.GGUFReader = made


def read_gguf(path: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json fields as transformers reads them from the metadata, HF-named float32
  tensors) of the GGUF file `path`, read inside `one_reader(path, open_gguf(path))` (checked
  first, opened once), as `import_gguf` does."""
  import torch
  from transformers import AutoConfig
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  from transformers.models.auto.modeling_auto import AutoModelForCausalLM
  hf = load_gguf_checkpoint(path)["config"]
  hf.pop("_model_name_or_path", None)
  families.family_of(hf)  # model_type (transformers' name for the architecture)
  cfg = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items()
                                                  if k != "model_type"})
  with torch.device("meta"):  # names and shapes only: transformers maps GGUF names through it
    skeleton = AutoModelForCausalLM.from_config(cfg)
  try:
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
  except (ValueError, NotImplementedError, IndexError) as e:
    raise ValueError(f"--gguf: {path}: {str(e).splitlines()[0]}") from None
  return hf, {k: v.numpy() for k, v in tensors.items()}


def save_tokenizer(path: str, out: str) -> str:
  """transformers' GGUF tokenizer of `path` saved into folder `out` (tokenizer.json,
  tokenizer_config.json with bos/eos/pad, chat_template.jinja); returns out."""
  from transformers import AutoTokenizer
  folder, name = os.path.split(os.path.abspath(path))
  try:
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
  except (ValueError, KeyError, NotImplementedError) as e:
    raise ValueError(f"--gguf: no tokenizer can be built from {path}'s metadata "
                     f"({str(e).splitlines()[0]}); name one with --tokenizer") from None
  tok.save_pretrained(out)
  return out


def import_gguf(path: str, out: str, *, n_future: int, heads: str, init_heads: str = "copy",
                tokenizer: str = "", max_len: int = 0, dtype: str = "float32"
                ) -> ml_collections.ConfigDict:
  """GGUF file `path` -> workdir `out` with `n_future` heads of kind `heads` (from_hf.import_hf
  for the rest). Nothing is written unless every tensor reads with its shape."""
  check_out(out)
  from_hf.check_init_heads(init_heads)
  with one_reader(path, open_gguf(path)), tempfile.TemporaryDirectory() as tmp:
    hf, tensors = read_gguf(path)
    tok = tokenizer or save_tokenizer(path, tmp)
    try:
      return from_hf.import_source(hf, TensorDict(tensors), out, source=path, n_future=n_future,
                                   heads=heads, init_heads=init_heads, tokenizer=tok,
                                   max_len=max_len, dtype=dtype)
    except ValueError as e:
      msg = str(e)
      raise ValueError("--gguf:" + msg[len("--ckpt:"):] if msg.startswith("--ckpt:") else msg
                       ) from None
