"""`data.tokenizer = "hf"`: a Hugging Face `tokenizer.json` (Llama 3, Qwen2.5/Qwen3, Mistral,
DeepSeek-Coder), read with the `tokenizers` library (not transformers), with the byte and
SentencePiece tokenizers' interface.

`data.hf_tokenizer` names the tokenizer.json file or its folder. Special tokens: bos, eos and
pad from tokenizer_config.json's `bos_token` / `eos_token` / `pad_token` (strings or
AddedToken dicts) in that folder, else config.json's `*_token_id` (eos may be a list: the first
is the one appended), else eos stands in for a missing bos or pad (padding is masked; bos is
only added when asked). `encode(text)` is `PreTrainedTokenizerFast.encode(text,
add_special_tokens=False)`; `add_bos` puts the bos id first, which is what the template of a
Llama 3 tokenizer.json does (`prompt_bos`: whether the tokenizer's own template starts with bos,
for prompts "as the model expects").
"""

from __future__ import annotations

import json
import os

import numpy as np

TOKENIZER_JSON = "tokenizer.json"
CANNOT_ENCODE = "text the tokenizer cannot encode: "  # every tokenizer's encode error starts so
# copied with tokenizer.json (transformers 5 saves a chat template as chat_template.jinja)
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def resolve(path: str) -> str:
  """The tokenizer.json file that `path` (the file or its folder) names; ValueError if none."""
  path = os.path.expanduser(path)
  if os.path.isdir(path):
    path = os.path.join(path, TOKENIZER_JSON)
  if not os.path.isfile(path):
    raise ValueError(f"config.data.hf_tokenizer: no tokenizer.json at {path!r}")
  return path


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"config.data.hf_tokenizer: {path} is not JSON ({e})") from None


class HFTokenizer:
  """tokenizer.json through `tokenizers.Tokenizer`, ids as the model's embedding rows."""

  def __init__(self, path: str):
    import tokenizers
    self.path = resolve(path)
    folder = os.path.dirname(self.path)
    try:
      self._tok = tokenizers.Tokenizer.from_file(self.path)
    except Exception as e:  # (the Rust side raises Exception)
      raise ValueError(f"config.data.hf_tokenizer: cannot read {self.path} "
                       f"({str(e).splitlines()[0]})") from None
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    tok_cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    model_cfg = _read_json(os.path.join(folder, "config.json"))
    ids = {name: self._special(name, tok_cfg, model_cfg) for name in ("bos", "eos", "pad")}
    if ids["eos"] is None:
      raise ValueError(f"config.data.hf_tokenizer: {folder} names no eos token (eos_token in "
                       "tokenizer_config.json or eos_token_id in config.json)")
    self.eos_id = ids["eos"]
    self.bos_id = ids["bos"] if ids["bos"] is not None else self.eos_id
    self.pad_id = ids["pad"] if ids["pad"] is not None else self.eos_id
    self.has_bos = ids["bos"] is not None
    # Does the tokenizer's own template (post-processor) start a text with bos (Llama 3)?
    templ = self._tok.encode("a", add_special_tokens=True).ids
    self.prompt_bos = bool(self.has_bos and templ and templ[0] == self.bos_id)
    unk = self._tok.model.unk_token if hasattr(self._tok.model, "unk_token") else None
    self.unk_id = self._tok.token_to_id(unk) if unk else None
    self._special_V = np.zeros(max(self.vocab_size, 1), bool)
    for i in self._special_ids():
      if 0 <= i < self.vocab_size:
        self._special_V[i] = True

  def _special(self, name: str, tok_cfg: dict, model_cfg: dict) -> int | None:
    token = tok_cfg.get(f"{name}_token")
    if isinstance(token, dict):
      token = token.get("content")
    if token:
      i = self._tok.token_to_id(token)
      if i is None:
        raise ValueError(f"config.data.hf_tokenizer: tokenizer_config.json's {name}_token "
                         f"{token!r} is not in {self.path}")
      return int(i)
    i = model_cfg.get(f"{name}_token_id")
    if isinstance(i, list):
      i = i[0] if i else None
    return None if i is None else int(i)

  def _special_ids(self):
    added = self._tok.get_added_tokens_decoder() if hasattr(
        self._tok, "get_added_tokens_decoder") else {}
    return {self.pad_id, self.bos_id, self.eos_id} | {i for i, t in added.items() if t.special}

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ValueError(f"{CANNOT_ENCODE}{text[e.start:e.end]!r} at character {e.start} is "
                       f"not valid Unicode ({e.reason})") from None
    ids_T = np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)
    if self.unk_id is not None and (ids_T == self.unk_id).any():
      raise ValueError(f"{CANNOT_ENCODE}{self._first_unknown(text)!r} maps to the unknown token of "
                       f"{self.path!r} (a tokenizer without byte fallback)")
    return np.concatenate([[self.bos_id]] * add_bos + [ids_T] + [[self.eos_id]] * add_eos
                          ).astype(np.int32)

  def _first_unknown(self, text: str) -> str:
    enc = self._tok.encode(text, add_special_tokens=False)
    for i, (start, end) in zip(enc.ids, enc.offsets):
      if i == self.unk_id:
        return text[start:end]
    return text[:20]

  def decode(self, ids) -> str:
    ids_T = np.asarray(ids).reshape(-1).astype(np.int64)
    ids_T = ids_T[(ids_T >= 0) & (ids_T < self.vocab_size)]
    return self._tok.decode(ids_T[~self._special_V[ids_T]].tolist(), skip_special_tokens=False)


  def token(self, i: int) -> str | None:
    return self._tok.id_to_token(i)


def copy_files(tok: HFTokenizer, out: str) -> str:
  """Copies tokenizer.json (and tokenizer_config.json, special_tokens_map.json beside it) into
  folder `out`, which may hold another config.json: without a tokenizer_config.json, one naming
  the special tokens `tok` found is written, so the copy has the same ids. Returns the copy's
  path."""
  import shutil
  src, dst = tok.path, os.path.join(out, TOKENIZER_JSON)
  if os.path.abspath(src) == os.path.abspath(dst):
    return dst
  shutil.copyfile(src, dst)
  for name in SIDE_FILES:
    side = os.path.join(os.path.dirname(src), name)
    if os.path.isfile(side):
      shutil.copyfile(side, os.path.join(out, name))
  if not os.path.isfile(os.path.join(out, "tokenizer_config.json")):
    specials = {"eos_token": tok.token(tok.eos_id), "pad_token": tok.token(tok.pad_id),
                "bos_token": tok.token(tok.bos_id) if tok.has_bos else None}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
      json.dump(specials, f, indent=2)
  return dst
