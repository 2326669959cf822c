"""Fine-tune the heads of an imported model (python -m mtp_jax.convert from-hf): the model and
tokenizer are the workdir's own, training starts from its params (train.init_from), and only
heads 2..n train (optim.trainable = "heads"; "all" fine-tunes everything with the MTP loss, as
Gloeckle et al. 2024's fine-tuning experiments do). The corpus is yours: text_folder over your
code, or any corpus in docs/data.md.

  python -m mtp_jax.train --config configs/finetune.py:IMPORTED --workdir RUN \\
      --config.data.corpus=text_folder --config.data.folder=~/my_code
"""

import os

from mtp_jax import config as config_lib
from mtp_jax import workdir


def get_config(init_from: str = ""):
  if not init_from:
    raise ValueError("configs/finetune.py needs the imported workdir: "
                     "--config configs/finetune.py:WORKDIR")
  path = workdir.config_path(os.path.expanduser(init_from))
  if not os.path.isfile(path):
    raise ValueError(f"configs/finetune.py: {init_from!r} has no {workdir.CONFIG}")
  c = config_lib.load_json(path)
  c.train.init_from = os.path.abspath(os.path.expanduser(init_from))
  c.optim.trainable = "heads"
  c.optim.lr = 1e-3  # new heads on a fixed trunk: a short run, no long warmup
  c.optim.warmup_steps = 20
  c.optim.weight_decay = 0.0
  c.train.steps = 1000
  c.train.batch_size = 16
  c.model.remat_policy = "full"  # a pretrained trunk at data.seq_len tokens: keep activations low
  return c
