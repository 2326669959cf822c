"""New heads on a trained model, trained heads-only on self-distilled data against the original
corpus, same steps: teacher-forced acceptance per head and decoding's tokens per forward.

    python experiments/distill_heads.py --source /work/runs/demo400 --root runs/distill_heads \\
        --json experiments/results/distill_heads.json

1. base: the source workdir's latest checkpoint with heads 2..n restarted as its head kind
   starts new heads on a pretrained model (`HeadKind.warm_start`; parallel: copies of head 1's
   block), written as a workdir; head 1 and the trunk are the source's.
2. distilled: `python -m mtp_jax.decoding.distill` with the source workdir (its own heads draft) on
   the train split of the source's corpus: each file's first --prompt_len tokens, continued for
   --max_new_tokens by head 1 (greedy, or --temperature).
3. Two runs from base (train.init_from, optim.trainable = "heads", same steps, batch, lr):
   one on the source's corpus, one on the distilled shards.
4. Each run, base and the source itself: teacher-forced agreement of head k with head 1 on the
   corpus's validation split (what bench_decode reports), its head losses there, and greedy
   self-speculative decoding of held-out prompts with every head (bench_decode.run_cell: a,
   acceptance by position).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import json
import os
import time

import jax
import numpy as np

from experiments import bench_decode

from experiments import common
from mtp_jax import config as config_lib
from mtp_jax.backends.cpu import runtime
from mtp_jax.config import validation
from mtp_jax import convert, train
from mtp_jax import heads as heads_lib
from mtp_jax.data import corpus as corpus_lib
from mtp_jax.decoding import distill, speed
from mtp_jax.workdir import load_workdir


def make_base(source: str, root: str):
  """(snapshot, base) workdirs: the source's latest checkpoint as it is, and with heads 2..n
  restarted; both written once, so every step below sees the same head 1 and trunk."""
  snap, base = os.path.join(root, "source_snapshot"), os.path.join(root, "base")
  if not os.path.isfile(os.path.join(base, "config.json")):
    loaded = load_workdir(source)
    params = jax.tree.map(np.array, jax.device_get(loaded.params))
    convert.write_workdir(snap, loaded.config.copy_and_resolve_references(), params)
    heads_lib.KINDS[loaded.model.args.head_kind].warm_start(params["heads"], loaded.model.args)
    convert.write_workdir(base, loaded.config.copy_and_resolve_references(), params)
    with open(os.path.join(root, "source_step.json"), "w") as f:
      json.dump({"source": source, "step": loaded.step}, f)
  with open(os.path.join(root, "source_step.json")) as f:
    return snap, base, json.load(f)["step"]


def evaluate(workdir: str, corpus_config, args) -> dict:
  loaded = load_workdir(workdir)
  loaded.config = corpus_config  # score every model on the same held-out corpus
  agree = bench_decode.teacher_forced(loaded, batches=args.eval_batches)["agreement"]
  prompts = bench_decode.heldout_prompts(loaded, args.decode_batch, args.decode_prompt_len)
  chain = {"name": "chain:all", "k": loaded.model.args.n_future, "tree": None}
  (r,) = bench_decode.run_cell(loaded, prompts, [chain], args.decode_new_tokens, speed.REPS)
  return {"step": loaded.step, "teacher_forced_agreement": agree, "a": r["a"],
          "a_batch": r["a_batch"], "acceptance_by_position": r["acceptance_by_position"],
          "identical_to_greedy": r["identical"]}


def run_config(base_config, base_wd: str, args, files: str = ""):
  c = base_config.copy_and_resolve_references()
  c.train.init_from, c.optim.trainable = os.path.abspath(base_wd), "heads"
  c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay = args.lr, args.warmup, 0.0
  c.train.steps, c.train.batch_size, c.data.seq_len = args.steps, args.batch_size, args.seq_len
  c.train.log_every, c.train.eval_every = max(1, args.steps // 5), args.steps
  c.train.checkpoint_every, c.train.eval_batches, c.train.async_checkpoints = args.steps, 2, False
  if files:
    c.data.corpus, c.data.files, c.data.val_files = "array_record", files, ""
  return validation.resolve(c)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--source", required=True, help="a trained workdir (read only)")
  ap.add_argument("--root", required=True, help="folder for the base, data and runs")
  ap.add_argument("--json", default=None)
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--batch_size", type=int, default=8)
  ap.add_argument("--seq_len", type=int, default=128)
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--warmup", type=int, default=5)
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--max_new_tokens", type=int, default=96)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--max_prompts", type=int, default=0)
  ap.add_argument("--eval_batches", type=int, default=4)
  ap.add_argument("--decode_batch", type=int, default=8)
  ap.add_argument("--decode_prompt_len", type=int, default=64)
  ap.add_argument("--decode_new_tokens", type=int, default=64)
  args = ap.parse_args(argv)
  os.makedirs(args.root, exist_ok=True)
  t0 = time.time()
  snap_wd, base_wd, source_step = make_base(args.source, args.root)
  corpus = validation.resolve(config_lib.load_json(os.path.join(base_wd, "config.json")))
  d = corpus.data
  if d.corpus == "tfds":
    spec, data_dir, text_key = f"tfds:{d.tfds_name}", d.tfds_data_dir, d.text_key
  else:  # a local corpus tfds builds (python_code, text_folder): its prepared files
    name = corpus_lib.get(d).prepare(d).info.full_name.rsplit("/", 1)[0]  # no version
    spec, data_dir, text_key = f"tfds:{name}", d.dir, "text"
  dist_dir = os.path.join(args.root, "distilled")
  t = time.time()
  meta = (json.load(open(os.path.join(dist_dir, "metadata.json")))
          if os.path.isfile(os.path.join(dist_dir, "metadata.json")) else
          distill.distill(snap_wd, spec, dist_dir, prompt_len=args.prompt_len,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          batch_size=32, shards=4, max_prompts=args.max_prompts,
                          split=d.train_split, tfds_data_dir=data_dir, text_key=text_key))
  distill_s = time.time() - t
  runs = {}
  for name, files in (("corpus", ""), ("distilled", f"{dist_dir}/tokens-*.array_record")):
    wd = os.path.join(args.root, name)
    t = time.time()
    summary = train.train(run_config(corpus, base_wd, args, files), wd)
    runs[name] = {"workdir": wd, "train_seconds": time.time() - t, "step": summary["step"]}
  results = {"source": args.source, "source_step": source_step, "args": vars(args),
             "distilled": {"documents": meta["documents"], "tokens": meta["tokens"],
                           "source": spec, "seconds": distill_s},
             "models": {}}
  for name, wd in (("new_heads_before_training", base_wd), ("corpus", runs["corpus"]["workdir"]),
                   ("distilled", runs["distilled"]["workdir"]),
                   ("source_jointly_trained_heads", snap_wd)):
    results["models"][name] = dict(evaluate(wd, corpus, args), **runs.get(name, {}))
    m = results["models"][name]
    print(f"{name}: agreement {np.round(m['teacher_forced_agreement'], 3).tolist()} "
          f"a {m['a']:.2f} acceptance {np.round(m['acceptance_by_position'], 3).tolist()}",
          flush=True)
  results["wall_seconds"] = time.time() - t0
  results["load_avg_1min_end"] = os.getloadavg()[0]
  common.emit(results, args.json, indent=1)


if __name__ == "__main__":
  main()
