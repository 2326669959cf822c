"""DeepSeek-V3-style sequential MTP at the Llama-2-7B shape: one MTP depth (n_future 2, as
DeepSeek-V3 trains it), arXiv 2412.19437 §2.2, for a TPU pod slice.

The 32-layer trunk is the whole next-token model; the depth module adds one block and the 2d->d
eh_proj (~0.24B params) and shares the embedding and output matrix. Loss: main + lambda / D *
depth loss, lambda 0.3 (DeepSeek-V3's value for the first 10T tokens), preset as in the released
weights ([emb; h], trunk state after the final norm, the depth's own output norm). Shape and
training fields as paper_7b_n4.py. Check the fit first:

    python experiments/plan_memory.py --config configs/paper_deepseek_seq.py --devices 256 \
        --mesh fsdp=256

(Its n_future = 1 line there is the 32-layer model without the depth, so not matched params.)
"""

import os

from mtp_jax.config import load_file


def get_config():
  c = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper_7b_n4.py"))
  m = c.model
  m.n_future = 2
  m.heads.kind = "sequential"
  m.heads.seq_preset = "deepseek_v3"
  c.loss.head_weights = "deepseek"
  c.loss.mtp_lambda = 0.3
  return c
