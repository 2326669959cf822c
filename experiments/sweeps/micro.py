"""A seconds-long sweep for tests and smoke checks: 2 tiny sizes x n_future in {1, 2}, 10 steps.

    python experiments/sweep.py --sweep experiments/sweeps/micro.py --root /tmp/micro --parallel 2
"""

BASE_CONFIG = "configs/tiny.py"
COMMON = {"train.steps": 10, "train.eval_every": 10, "train.checkpoint_every": 10,
          "train.log_every": 5}
SIZES = [(32, 2), (48, 3)]  # (d_model, n_layers); n_layers counts the head blocks


def get_runs():
  return [{"model.d_model": d, "model.n_layers": layers, "model.d_ff": 2 * d,
           "model.n_future": n, "seed": 0}
          for d, layers in SIZES for n in (1, 2)]
