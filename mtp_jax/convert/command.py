"""`python -m mtp_jax.convert COMMAND --flag ...`: the command line of the imports and the export
(absl flags through mtp_jax.cli; bad input is one `error: ...` line and exit status 2)."""

from __future__ import annotations

import sys

from absl import flags, logging

from mtp_jax import cli
from mtp_jax import config as config_lib
from mtp_jax.convert import export, from_gguf, from_hf, workdir

USAGE = """usage:
  python -m mtp_jax.convert meta --ckpt DIR --out WORKDIR [--tokenizer PATH]
  python -m mtp_jax.convert deepseek --ckpt DIR --out WORKDIR [--tokenizer PATH]
  python -m mtp_jax.convert to-hf --workdir WORKDIR --out DIR
  python -m mtp_jax.convert to-meta|to-deepseek --workdir WORKDIR --out DIR
  python -m mtp_jax.convert from-hf --ckpt DIR --out WORKDIR --n_future 4 \
      --heads parallel|projection|sequential [--init_heads copy|random] [--tokenizer PATH]
  python -m mtp_jax.convert from-gguf --gguf FILE --out WORKDIR --n_future 4 \
      --heads parallel|projection|sequential [--init_heads copy|random] [--tokenizer PATH]"""


def _define_target(fv: flags.FlagValues, tokenizer_default: str) -> None:
  flags.DEFINE_string("out", None, "workdir to write", flag_values=fv)
  flags.DEFINE_string("tokenizer", "", f"tokenizer.json or SentencePiece model (default: "
                      f"{tokenizer_default})", flag_values=fv)
  flags.DEFINE_integer("max_len", 0, "longest sequence for generate (default: from the "
                       "checkpoint's config)", lower_bound=0, flag_values=fv)
  flags.DEFINE_enum("dtype", "float32", config_lib.DTYPES,
                    "stored parameter dtype (restored as float32)", flag_values=fv)


def _define_import(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("ckpt", None, "checkpoint folder", flag_values=fv)
  _define_target(fv, "tokenizer.model or tokenizer.json in --ckpt")


def _define_heads(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("n_future", None, "heads, head 1 included (>= 2)", flag_values=fv)
  flags.DEFINE_string("heads", None, "head kind (a name in mtp_jax.heads.KINDS)", flag_values=fv)
  flags.DEFINE_enum("init_heads", "copy", list(from_hf.INIT_HEADS),
                    "new heads start as copies of head 1 or from the model's initialiser",
                    flag_values=fv)


def _define_from_hf(fv: flags.FlagValues) -> None:
  _define_import(fv)
  _define_heads(fv)


def _define_from_gguf(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("gguf", None, "a GGUF file (llama.cpp's format) of a Llama-architecture "
                      "model, any tensor type the gguf package dequantizes", flag_values=fv)
  _define_target(fv, "transformers' tokenizer from the GGUF metadata")
  _define_heads(fv)


def _define_export(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "a training or imported workdir", flag_values=fv)
  flags.DEFINE_string("out", None, "folder for the exported files", flag_values=fv)


COMMANDS = {
    "meta": cli.Command(
        "import facebook/multi-token-prediction (params.json, *.pth) into a workdir",
        _define_import, ("ckpt", "out")),
    "deepseek": cli.Command(
        "import dense Llama + DeepSeek-V3 MTP layers, HF safetensors, into a workdir",
        _define_import, ("ckpt", "out")),
    "from-hf": cli.Command(
        "add MTP heads to a HF LlamaForCausalLM (safetensors): head 1 is the HF model",
        _define_from_hf, ("ckpt", "out", "n_future", "heads")),
    "from-gguf": cli.Command(
        "add MTP heads to a Llama-architecture GGUF file: head 1 is the GGUF model",
        _define_from_gguf, ("gguf", "out", "n_future", "heads")),
    "to-hf": cli.Command("export trunk + head 1 as a HF LlamaForCausalLM",
                                 _define_export, ("workdir", "out")),
    "to-meta": cli.Command("export parallel heads in Meta's layout (params.json, *.pth)",
                           _define_export, ("workdir", "out")),
    "to-deepseek": cli.Command("export sequential heads as DeepSeek-V3 MTP layers (safetensors)",
                               _define_export, ("workdir", "out")),
}


def main(argv=None) -> int:
  """`argv` without the program name (default sys.argv[1:]); returns the exit status."""
  try:
    command, fv = cli.parse_command(argv, COMMANDS, prog="python -m mtp_jax.convert",
                                            usage=USAGE)
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    if command == "to-hf":
      hf = workdir.export_hf(fv.workdir, fv.out)
      print(f"wrote {fv.out}: LlamaForCausalLM, {hf['num_hidden_layers']} layers")
      return 0
    if command in ("to-meta", "to-deepseek"):
      fn = export.export_meta if command == "to-meta" else export.export_deepseek
      fn(fv.workdir, fv.out)
      print(f"wrote {fv.out}: {command[3:]} layout with every head; import it back with "
            f"python -m mtp_jax.convert {command[3:]} --ckpt {fv.out} --out WORKDIR")
      return 0
    if command == "from-gguf":
      c = from_gguf.import_gguf(fv.gguf, fv.out, n_future=fv.n_future, heads=fv.heads,
                                init_heads=fv.init_heads, tokenizer=fv.tokenizer,
                                max_len=fv.max_len, dtype=fv.dtype)
    elif command == "from-hf":
      c = from_hf.import_hf(fv.ckpt, fv.out, n_future=fv.n_future, heads=fv.heads,
                            init_heads=fv.init_heads, tokenizer=fv.tokenizer,
                            max_len=fv.max_len, dtype=fv.dtype)
    else:
      fn = workdir.import_meta if command == "meta" else workdir.import_deepseek
      c = fn(fv.ckpt, fv.out, tokenizer=fv.tokenizer, max_len=fv.max_len, dtype=fv.dtype)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {fv.out}: {c.model.heads.kind} heads, n_future {c.model.n_future}, "
        f"{c.model.n_layers} layers; try python -m mtp_jax.generate --workdir {fv.out} "
        "--mode both --prompt ...")
  return 0
