"""Polynomial arithmetic (Gloeckle et al. 2024 §4.2): a small byte-level model, minutes on CPU.

The paper's ring F_7[X]/(X^5) with +, - (negation) and *; add "o" (composition, as the paper
does) with --config.data.poly_ops=+-*o. Train on 1..5 operations, test_ood on 6..8. Accuracy
is exact match of the answer by greedy decoding, in distribution (validation) and out of it
(test_ood): `python -m mtp_jax.evaluation.tasks_eval --workdir DIR`. Hard at CPU budgets: d_model
32 and 64 stay at chance after 300 steps (experiments/results/small_tasks.json), so give it
thousands of steps, or fewer operations (--config.data.poly_ops=-).

d_model 64, 6 blocks; n_future 4 (--config.model.n_future=4) takes 3 of them for extra heads
(2 trunk + 4 head blocks, the same parameters).
"""

from mtp_jax.config import base_config


def get_config():
  c = base_config()
  c.data.corpus = "polynomial"
  c.data.seq_len = 64  # the longest train example (5 operations) is 51 characters
  c.data.whole_docs = True  # an example is never cut off from its prompt
  c.data.task_train_size = 100_000
  c.data.poly_modulus = 7
  c.data.poly_degree = 5
  c.data.poly_ops = "+-*"
  c.data.poly_train_ops = 5
  c.data.poly_ood_ops = 8
  c.model.d_model = 64
  c.model.n_layers = 6
  c.model.n_heads = 2
  c.model.n_kv_heads = 2
  c.model.d_ff = 192
  c.model.max_len = 128  # test_ood examples run to 75 characters
  c.model.n_future = 1
  c.train.batch_size = 32
  c.train.steps = 600
  c.train.log_every = 100
  c.train.eval_every = 600
  c.train.eval_batches = 4
  c.train.checkpoint_every = 600
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 50
  return c
