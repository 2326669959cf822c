"""auto's predicted a (the expected slowest row, `costmodel.predict_a`) against the a that decodes
with other sampling seeds and other prompts of the same shape actually get.

    python experiments/slowest_row.py --workdir runs/proj --batch 8 --prompt_len 64 \\
        --max_new_tokens 128 --k 2 --temperature 0.8 --draws 30 \\
        --json experiments/results/slowest_row_projection_bytes_sampled_b8p64_epyc.json

The probe: the chain of k decoding bench_decode's held-out prompts (seed 0) with sampling seed
0, as auto's probe and bench_decode's timed calls do. From its per-row histogram, the predicted
a two ways: the expected slowest row of the batch (the rule auto uses) and the slowest row's mean
(no spread). Then --draws decodes with the seed varied (the same prompts) and --draws with the
prompts varied too (held-out windows drawn with seeds 1..draws), each giving the batch's a as
bench_decode measures it (plain decoding's forwards over the chain's). Per set: the realized
a's geometric mean and log sd, log(predicted / realized mean) and a one-sample t-test's p. Greedy
(--temperature 0) varies the prompts alone (a seed changes nothing).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse

import numpy as np
from scipy import stats

from experiments import common
from experiments.bench_decode import heldout_prompts
from mtp_jax.decoding import costmodel
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.workdir import load_workdir


def _against(pred: float, realized: list[float]) -> dict:
  logs = np.log(realized)
  out = {"draws": len(realized), "a_mean": float(np.exp(logs.mean())),
         "a_range": [float(min(realized)), float(max(realized))],
         "log_sd": float(logs.std(ddof=1)) if len(realized) > 1 else None,
         "log_predicted_over_realized": float(np.log(pred) - logs.mean())}
  if len(realized) > 2 and np.ptp(logs) > 0:
    out["p"] = float(stats.ttest_1samp(logs, np.log(pred)).pvalue)
  return out


def run(loaded, *, batch: int, prompt_len: int, max_new_tokens: int, k: int, temperature: float,
        draws: int) -> dict:
  """The module docstring's measurement; returns its record (without the machine)."""
  shape = dict(batch=batch, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
               sampling=temperature > 0)
  chain_dec = decode_lib.Decoder(loaded.params, loaded.model.args, k=k, **shape)
  plain_dec = decode_lib.Decoder(loaded.params, loaded.model.args, k=1, **shape)
  ids = dict(eos_id=-1, pad_id=loaded.tokenizer.pad_id)
  kw = lambda seed: (dict(temperature=temperature, top_p=0.95, top_k=0, seed=seed)
                     if temperature > 0 else {})

  def a_of(prompts, seed):
    r = chain_dec(prompts, **ids, **kw(seed))
    return r, plain_dec(prompts, **ids, **kw(seed)).forwards / r.forwards

  prompts0 = heldout_prompts(loaded, batch, prompt_len, seed=0)
  probe, a0 = a_of(prompts0, 0)
  chain = costmodel.chain(k)
  pred = costmodel.predict_a(probe.rows_hist, chain, chain, max_new_tokens=max_new_tokens)
  out = {"a_probe": a0, "a_predicted": pred,
         "a_slowest_row_mean": costmodel.predict_a(probe.rows_hist, chain, chain)}
  sets = {"prompts": lambda i: (heldout_prompts(loaded, batch, prompt_len, seed=i), i)}
  if temperature > 0:
    sets = {"seeds": lambda i: (prompts0, i), **sets}
  for name, draw in sets.items():
    realized = [a_of(*draw(i))[1] for i in range(1, draws + 1)]
    out[name] = _against(pred, realized)
    print(f"{name} varied: a {out[name]['a_mean']:.3f} over {draws} (predicted {pred:.3f}, "
          f"the probe's own {a0:.3f})", flush=True)
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--max_new_tokens", type=int, default=128)
  ap.add_argument("--k", type=int, default=2, help="the chain of heads 1..k")
  ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled (top-p 0.95)")
  ap.add_argument("--draws", type=int, default=30)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  if args.draws < 3 or args.batch < 1:
    ap.error(f"--draws: at least 3, --batch: at least 1; got {args.draws}, {args.batch}")
  loaded = load_workdir(args.workdir)
  if not 2 <= args.k <= loaded.model.args.n_future:
    ap.error(f"--k: 2 to the model's {loaded.model.args.n_future} heads, got {args.k}")
  result = {"workdir": args.workdir, "batch": args.batch, "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens, "k": args.k,
            "temperature": args.temperature,
            **run(loaded, batch=args.batch, prompt_len=args.prompt_len,
                  max_new_tokens=args.max_new_tokens, k=args.k, temperature=args.temperature,
                  draws=args.draws)}
  common.emit(result, args.json)
  return result


if __name__ == "__main__":
  main()
