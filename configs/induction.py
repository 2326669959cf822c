"""Induction (Gloeckle et al. 2024 §4.1): a small byte-level model, minutes on 2 CPU cores.

63-letter examples (64 tokens with eos, one example a row): lowercase filler and 6 two-letter
names ("Xy") planted 5 times each, so 24 of the 63 next-letter predictions are copies of a
name's second letter; `python -m mtp_jax.evaluation.tasks_eval --workdir DIR` scores only those.
Names this dense (and lr 1e-2) are what lets copying start within 1000 steps (accuracy 0.13-0.18
against chance 0.038 at d_model 32 and 64): with 4 names planted 3 times, 1500 steps at lr 3e-3
stayed at chance.

At 3000 steps and d_model 32 (experiments/small_tasks.py, README), n_future 2 forms induction
(accuracy ~0.99) while n_future 1 and 4 stay near 0.19, in both seeds tried.

d_model 64, 6 blocks; n_future 4 (--config.model.n_future=4) takes 3 of them for extra heads
(2 trunk + 4 head blocks, the same parameters), so every head is still 3 blocks deep.
"""

from mtp_jax.config import base_config


def get_config():
  c = base_config()
  c.data.corpus = "induction"
  c.data.seq_len = 64
  c.data.whole_docs = True
  c.data.task_train_size = 50_000
  c.data.induction_len = 63
  c.data.induction_pairs = 6
  c.data.induction_repeats = 5
  c.model.d_model = 64
  c.model.n_layers = 6
  c.model.n_heads = 2
  c.model.n_kv_heads = 2
  c.model.d_ff = 192
  c.model.max_len = 64
  c.model.n_future = 1
  c.train.batch_size = 32
  c.train.steps = 600
  c.train.log_every = 100
  c.train.eval_every = 600
  c.train.eval_batches = 4
  c.train.checkpoint_every = 600
  c.optim.lr = 1e-2
  c.optim.warmup_steps = 50
  return c
