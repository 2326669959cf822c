"""Model size x n_future in {1, 4}: does multi-token prediction help more as models grow?
(Gloeckle et al. 2024, §3.1 and Fig. 3, at CPU scale.)

    python experiments/sweep.py --sweep experiments/sweeps/size_x_n.py --root runs/size_x_n \
        --parallel 2
    python experiments/analyze_sweep.py runs/size_x_n

Byte-level code (configs/default.py: the local stdlib corpus, seq 256, batch 16), parallel
heads. n_layers counts the head blocks (3 extra for n = 4 come out of the trunk), so both n have
the same parameters at a size. Every run sees the same tokens (STEPS * 16 * 256). Sized for
about 30 minutes on 2 idle CPU cores with --parallel 2 (one core a run; step times measured
alone); the run in experiments/results took 53 minutes with other jobs on the machine. The
largest runs come first so the two slots finish together.
"""

BASE_CONFIG = "configs/default.py"
STEPS = 180
COMMON = {"train.steps": STEPS, "optim.warmup_steps": 20, "train.eval_every": STEPS,
          "train.eval_batches": 8, "train.checkpoint_every": 50, "train.log_every": 10}
# (d_model, n_layers), largest first; d_ff = 3 * d_model as in the default; 8 attention heads.
# 6 layers at every size, so the n = 4 models keep a 2-block shared trunk (with 4 layers their
# trunk would be empty and the comparison would be about depth, not extra heads).
SIZES = [(256, 6), (192, 6), (128, 6), (64, 6)]


def get_runs():
  return [{"model.d_model": d, "model.n_layers": layers, "model.d_ff": 3 * d,
           "model.n_future": n, "seed": 0}
          for d, layers in SIZES for n in (1, 4)]
