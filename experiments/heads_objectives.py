"""Which objective for heads 2..n gets self-speculative drafts accepted most often? New heads
(copies of head 1) on a trained model, trained heads-only by ce, kl_to_head1, tv and ce with a
head curriculum, on the source's corpus and on self-distilled data, over seeds.

    python experiments/heads_objectives.py --source /work/runs50/demo --root runs/heads_obj \\
        --json experiments/results/heads_objectives.json [--steps 150 --seeds 0,1]
    python experiments/heads_objectives.py --source RUN --root /tmp/ho --json /tmp/ho.json --smoke

Base: the source with heads 2..n restarted (`distill_heads.make_base`); distilled data: `distill`
of the source, built once. One run (init_from base, trainable heads; same steps, batch, seq len,
lr) per objective x data x seed, a workdir each under --root, finished runs kept and their scores
cached (rerun to continue). Every model is scored on the source corpus's validation split
(`train.validation_metrics`: alpha_k greedy / sampled, the a they estimate by
`acceptance.leviathan_a`) and by self-speculative decoding (a chain of all heads) of held-out
prompts, greedy (asserted equal to plain greedy) and sampled, per batch size: a, a_batch,
P(>= j drafts pass), alpha_j. Per arm: mean, spread (max - min), std over seeds; a markdown table,
a verdict, --json and NAME.png.
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

from experiments import bench_decode, common, distill_heads
from mtp_jax import acceptance
from mtp_jax import config as config_lib
from mtp_jax import heads as heads_lib
from mtp_jax import sharding as shard_lib
from mtp_jax import steps as steps_lib
from mtp_jax import train
from mtp_jax import workdir as workdir_lib
from mtp_jax.config import validation
from mtp_jax.data import corpus as corpus_lib
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.decoding import distill
from mtp_jax.model import build_model

OBJECTIVES = {"ce": {"draft_objective": "ce"},
              "kl_to_head1": {"draft_objective": "kl_to_head1"},
              "tv": {"draft_objective": "tv"},
              "ce+curriculum": {"draft_objective": "ce", "head_curriculum": 0.5}}
DATA = ("stdlib", "distilled")
SEED_CHANGES = ("data.shuffle_seed: the order of the training documents and rows (config.seed "
                "is set too but unused: every run starts from the base's params, heads 2..n "
                "copies of head 1, and a train step draws no random numbers)")
VERDICT_METRIC = "decode/sampled_b1/a"
EVAL_FILE = "heads_objectives_eval.json"
FLAGS = [  # name, default, help
    ("json", "experiments/results/heads_objectives.json", "the results (and NAME.png)"),
    ("steps", 150, "train steps per run"), ("batch_size", 8, ""), ("seq_len", 128, ""),
    ("lr", 1e-3, ""), ("warmup", 10, ""), ("seeds", "0,1", "training seeds (data.shuffle_seed)"),
    ("arms", ",".join(OBJECTIVES), "objectives"), ("data", ",".join(DATA), "data sources"),
    ("prompt_len", 32, "distill: prompt tokens"), ("max_new_tokens", 96, "distill: new tokens"),
    ("max_prompts", 1024, "distill: prompts (0: all)"), ("temperature", 0.0, "distill"),
    ("eval_batches", 8, "teacher-forced validation batches (of batch_size x seq_len)"),
    ("n_prompts", 16, "held-out decoding prompts"), ("decode_prompt_len", 64, ""),
    ("decode_new_tokens", 64, ""), ("batches", "1,8", "decoding batch sizes"),
    ("temperature_eval", 0.8, "sampled decoding"), ("top_p_eval", 0.95, "sampled decoding"),
    ("sample_seeds", "0,1,2", "sampled decoding: its seeds")]
SMOKE = dict(steps=2, seeds="0", sample_seeds="0", n_prompts=2, decode_new_tokens=8,
             max_prompts=8, max_new_tokens=16, eval_batches=1, warmup=1)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--source", help="a trained workdir (read only)")
  ap.add_argument("--root", help="folder for the base, the distilled data and the runs")
  common.add_flag_table(ap, FLAGS, SMOKE)
  ap.add_argument("--verdict", action="store_true",
                  help="print the table and verdict of an existing --json and exit")
  args = ap.parse_args(argv)
  if not args.verdict and not (args.source and args.root):
    ap.error("--source and --root are required (unless --verdict)")
  common.apply_smoke(ap, args, SMOKE)
  for flag in ("seeds", "sample_seeds", "batches"):
    text = getattr(args, flag)
    if not all(x.strip().isdigit() for x in text.split(",")):
      ap.error(f"--{flag}: a comma-separated list of integers, got {text!r}")
    setattr(args, flag, [int(x) for x in text.split(",")])
  args.batches = sorted({min(b, args.n_prompts) for b in args.batches})
  args.arms, args.data = args.arms.split(","), args.data.split(",")
  for flag, got, known in (("--arms", args.arms, OBJECTIVES), ("--data", args.data, DATA)):
    if bad := [x for x in got if x not in known]:
      ap.error(f"{flag}: unknown {bad}, known {list(known)}")
  if bad := [b for b in args.batches if b < 1 or args.n_prompts % b]:
    ap.error(f"--batches: {bad} must divide --n_prompts {args.n_prompts}")
  return args


def stats(values) -> dict:
  """mean, spread (max - min), std (ddof 1; 0 for one value) over seeds, elementwise for lists."""
  v = np.asarray(values, float)
  std = v.std(0, ddof=1) if len(v) > 1 else np.zeros_like(v[0])
  return {"mean": v.mean(0).tolist(), "spread": (v.max(0) - v.min(0)).tolist(),
          "std": std.tolist(), "values": v.tolist(), "n": len(v)}


def flatten(run: dict) -> dict:
  """A run's figures: {"tf/<eval figure>": ..., "decode/<mode>_b<B>/<figure>": ...} (the
  teacher-forced estimate of a under its current name, in runs scored before too)."""
  return {**{f"tf/{acceptance.renamed(k)}": v for k, v in run["eval"].items()},
          **{f"decode/{c}/{k}": v for c, figs in run["decode"].items() for k, v in figs.items()}}


def aggregate(runs: list[dict]) -> dict:
  """{"<objective>|<data>": {objective, data, seeds, figures: {figure: stats over seeds}}}."""
  arms = {}
  for r in runs:
    arms.setdefault(f"{r['objective']}|{r['data']}", []).append(r)
  out = {}
  for name, rs in arms.items():
    flat = [flatten(r) for r in rs]
    out[name] = {"objective": rs[0]["objective"], "data": rs[0]["data"],
                 "seeds": [r["seed"] for r in rs],
                 "figures": {k: stats([f[k] for f in flat]) for k in flat[0]
                             if all(k in f for f in flat)}}
  return out


def verdict(arms: dict, metric: str = VERDICT_METRIC) -> list[str]:
  """Per data source: the objective of highest mean `metric`, and whether its lead over ce
  exceeds the seed-to-seed spread (the larger max - min of the two arms)."""
  lines = []
  for data in dict.fromkeys(a["data"] for a in arms.values() if metric in a["figures"]):
    cand = {a["objective"]: a["figures"][metric] for a in arms.values()
            if a["data"] == data and metric in a["figures"]}
    b = cand[best := max(cand, key=lambda o: cand[o]["mean"])]
    line = (f"{data}: best {metric} is {best} ({b['mean']:.3f}, seed spread {b['spread']:.3f}, "
            f"{b['n']} seed(s))")
    if best == "ce" or "ce" not in cand:
      lines.append(line + ("; ce is the best" if best == "ce" else "; no ce arm to compare"))
      continue
    lead, noise = b["mean"] - cand["ce"]["mean"], max(b["spread"], cand["ce"]["spread"])
    lines.append(line + f"; lead over ce {lead:+.3f} against a seed spread of {noise:.3f}: "
                 + ("exceeds the seed-to-seed spread" if lead > noise and b["n"] > 1
                    and cand["ce"]["n"] > 1 else "within the noise"))
  return lines


def table(arms: dict, base: dict | None) -> str:
  """Markdown: the base and every arm's means (heads 2..n for the teacher-forced alphas)."""
  rows = [("base (before training)", flatten(base) if base else {})]
  rows += [(name, {k: v["mean"] for k, v in a["figures"].items()}
            | {f"{k}#spread": v["spread"] for k, v in a["figures"].items()})
           for name, a in arms.items()]
  fmt = lambda v: "-" if v is None else (" / ".join(f"{x:.3f}" for x in v) if isinstance(
      v, list) else f"{v:.3f}")
  cols = [("tf alpha greedy", "tf/alpha_greedy"), ("tf alpha sampled", "tf/alpha_sampled"),
          ("tf a est. sampled", f"tf/{acceptance.ESTIMATE}_sampled"),
          ("head1 loss - base", "tf/head1_loss_minus_base"), ("greedy a b1", "decode/greedy_b1/a"),
          ("sampled a b1", VERDICT_METRIC), ("its seed spread", f"{VERDICT_METRIC}#spread"),
          ("sampled alpha_j b1", "decode/sampled_b1/alpha_by_position")]
  out = ["| arm | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
  for name, f in rows:
    cells = [f.get(key) for _, key in cols]
    cells[:2] = [v and v[1:] for v in cells[:2]]  # head 1's alpha is 1
    out.append(f"| {name} | " + " | ".join(map(fmt, cells)) + " |")
  return "\n".join(out)


def plot(arms: dict, base: dict | None, path: str) -> None:
  """alpha_j by draft position at batch 1 (greedy, sampled; stdlib solid, distilled dashed;
  bars: seed min..max) and sampled a at batch 1 per arm (x: each seed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  color = {o: f"C{i}" for i, o in enumerate(OBJECTIVES)}
  style = {"stdlib": "o-", "distilled": "s--"}
  flat_base = flatten(base) if base else {}
  bar = lambda f: np.asarray([np.subtract(f["mean"], np.min(f["values"], 0)),
                              np.subtract(np.max(f["values"], 0), f["mean"])])
  for ax, mode in zip(axes[:2], ("greedy", "sampled")):
    key = f"decode/{mode}_b1/alpha_by_position"
    if key in flat_base:
      ax.plot(range(2, len(flat_base[key]) + 2), flat_base[key], "k:", label="base")
    for a in (a for a in arms.values() if key in a["figures"]):
      f = a["figures"][key]
      x = np.arange(2, len(f["mean"]) + 2)
      ax.errorbar(x, f["mean"], yerr=bar(f), fmt=style[a["data"]], color=color[a["objective"]],
                  capsize=3, label=f"{a['objective']} ({a['data']})")
      ax.set_xticks(x)
    ax.set(xlabel="head (draft position)", ylabel="alpha_j = P(>=j) / P(>=j-1)", ylim=(0, 1),
           title=f"Acceptance by position, batch 1, {mode}")
    ax.legend(fontsize=6)
  ax, names = axes[2], list(arms)
  for i, name in enumerate(names):
    if VERDICT_METRIC in arms[name]["figures"]:
      f, c = arms[name]["figures"][VERDICT_METRIC], color[arms[name]["objective"]]
      ax.plot([i] * len(f["values"]), f["values"], "x", color=c)
      ax.errorbar([i], [f["mean"]], yerr=np.reshape(bar(f), (2, 1)), capsize=4, color=c,
                  fmt=style[arms[name]["data"]][0])
  if VERDICT_METRIC in flat_base:
    ax.axhline(flat_base[VERDICT_METRIC], color="k", ls=":", label="base")
    ax.legend(fontsize=7)
  ax.set_xticks(range(len(names)), [n.replace("|", "\n") for n in names], fontsize=6)
  ax.set(ylabel="tokens per forward", title="Sampled a at batch 1 (x: seeds, bar: min..max)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


class Scorer:
  """Teacher-forced figures on the source corpus's validation split and self-speculative
  decoding of the held-out prompts, each compiled once for every model (a decoder takes the
  params as an argument: `Decoder.params` is swapped, not recompiled)."""

  def __init__(self, base_loaded, eval_config, args):
    self.args, self.config, self.margs = args, eval_config, base_loaded.model.args
    self.pad, self.decoders = base_loaded.tokenizer.pad_id, {}
    self.base_params = base_loaded.params
    self.eval_step = jax.jit(steps_lib.make_eval_step(build_model(eval_config), eval_config))
    self.batch_sh = shard_lib.batch_sharding(shard_lib.make_mesh(eval_config))
    self.prompts = [list(map(int, p)) for p in bench_decode.heldout_prompts(
        base_loaded, args.n_prompts, args.decode_prompt_len)]
    self.plain = self.plain_greedy(base_loaded.params)

  def _calls(self, params, k, b, seed, sample_kw) -> list:
    """Decodes the prompts b at a time with heads 1..k (greedy unless sample_kw)."""
    key = (k, b, bool(sample_kw))
    if key not in self.decoders:
      self.decoders[key] = decode_lib.Decoder(
          params, self.margs, k=k, batch=b, prompt_len=self.args.decode_prompt_len,
          max_new_tokens=self.args.decode_new_tokens, sampling=bool(sample_kw))
    d = self.decoders[key]
    d.params = decode_lib.slice_heads(params, self.margs, k)[0]
    return [d(self.prompts[i:i + b], eos_id=-1, pad_id=self.pad, seed=seed, **sample_kw)
            for i in range(0, len(self.prompts), b)]

  def plain_greedy(self, params) -> dict:
    return {b: self._calls(params, 1, b, 0, {}) for b in self.args.batches}

  def frozen_equal(self, params) -> bool:
    """Trunk and head 1 bit-identical to the base's (then plain decoding is the base's too)."""
    kind = heads_lib.KINDS[self.margs.head_kind]
    one = lambda p: jax.tree.leaves(heads_lib.slice_params(jax.device_get(p), kind, 1))
    return all(np.array_equal(x, y) for x, y in zip(one(params), one(self.base_params)))

  def teacher_forced(self, params) -> dict:
    ev = train.validation_metrics(self.eval_step, params, self.config, self.batch_sh)
    out = {k.replace("head_alpha", "alpha"): np.asarray(v).tolist() for k, v in ev.items()}
    return dict(out, head1_loss=out["head_loss"][0])

  def decoding(self, params) -> dict:
    k, out = self.margs.n_future, {}
    plain = self.plain if self.frozen_equal(params) else self.plain_greedy(params)
    sample_kw = dict(temperature=self.args.temperature_eval, top_p=self.args.top_p_eval)
    for mode, seeds, kw in (("greedy", [0], {}), ("sampled", self.args.sample_seeds, sample_kw)):
      for b in self.args.batches:
        rs = [r for s in seeds for r in self._calls(params, k, b, s, kw)]
        for r, g in zip(rs if mode == "greedy" else [], plain[b]):
          assert np.array_equal(r.tokens, g.tokens) and np.array_equal(r.lengths, g.lengths), (
              f"greedy decoding with {k} heads differs from plain greedy at batch {b}")
        m = common.merged_result(rs, k)  # every call of the cell as one result
        out[f"{mode}_b{b}"] = dict(  # a_batch: plain forwards / speculative forwards
            a=m.tokens_per_forward, a_batch=len(seeds) * sum(g.forwards for g in plain[b])
            / m.forwards, acceptance_by_position=m.acceptance_by_position().tolist(),
            alpha_by_position=m.alpha_by_position().tolist())
    return out

  def score(self, params, cache_path: str, key: dict) -> dict:
    """{"key", "eval": teacher-forced, "decode"}, from cache_path where its key is `key`."""
    cached = json.load(open(cache_path)) if os.path.isfile(cache_path) else {}
    if cached.get("key") == key:
      return cached
    out = {"key": key, "eval": self.teacher_forced(params), "decode": self.decoding(params)}
    common.write_json(out, cache_path)  # stamped with the machine, like the results
    return out


def run_config(base_config, base_wd: str, args, objective: str, seed: int, files: str = ""):
  c = base_config.copy_and_resolve_references()
  c.train.init_from, c.optim.trainable = os.path.abspath(base_wd), "heads"
  c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay = args.lr, args.warmup, 0.0
  c.train.steps, c.train.batch_size, c.data.seq_len = args.steps, args.batch_size, args.seq_len
  c.train.log_every, c.train.eval_every = max(1, args.steps // 5), args.steps
  c.train.checkpoint_every, c.train.async_checkpoints = args.steps, False
  c.train.eval_batches, c.train.stop_at, c.seed, c.data.shuffle_seed = (args.eval_batches, 0,
                                                                        seed, seed)
  c.loss.update(dict(dict(draft_objective="ce", head_curriculum=0.0), **OBJECTIVES[objective]))
  if files:
    c.data.corpus, c.data.files, c.data.val_files = "array_record", files, ""
  return validation.resolve(c)


def trained_summary(config, wd: str) -> dict | None:
  """The run's summary when it is finished with these settings (None: train or resume it);
  ValueError when the workdir holds a run with other settings."""
  if not os.path.isfile(os.path.join(wd, "config.json")):
    return None
  saved = config_lib.load_json(os.path.join(wd, "config.json"))
  norm = lambda c, g: json.dumps(c[g].to_dict(), sort_keys=True)  # tuples as lists
  if bad := [g for g in ("loss", "optim", "train") if norm(saved, g) != norm(config, g)] + [
      k for k in ("shuffle_seed", "corpus", "seq_len") if saved.data[k] != config.data[k]]:
    raise ValueError(f"{wd} holds a run with other {bad} settings: use another --root")
  s = workdir_lib.read_summary(wd)
  return s if s and s.get("step") == config.train.steps else None


def step_seconds(wd: str, tokens_per_step: int) -> float | None:
  """Median seconds per train step over the run's log lines after the first (its compile)."""
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    tps = [r["train/tokens_per_sec"] for r in map(json.loads, f) if "train/tokens_per_sec" in r]
  return float(np.median([tokens_per_step / x for x in tps[1:]])) if tps[1:] else None


def distilled_data(args, snap_wd: str, corpus) -> dict:
  """The distilled shards of the source's train split (built once, then read back)."""
  d, out = corpus.data, os.path.join(args.root, "distilled")
  if d.corpus == "tfds":
    spec, data_dir, text_key = f"tfds:{d.tfds_name}", d.tfds_data_dir, d.text_key
  else:  # a local corpus tfds builds (python_code, text_folder): its prepared files
    name = corpus_lib.get(d).prepare(d).info.full_name.rsplit("/", 1)[0]
    spec, data_dir, text_key = f"tfds:{name}", d.dir, "text"
  t, meta = time.time(), os.path.join(out, "metadata.json")
  meta = json.load(open(meta)) if os.path.isfile(meta) else distill.distill(  # built once
      snap_wd, spec, out, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
      temperature=args.temperature, batch_size=32, shards=4, max_prompts=args.max_prompts,
      split=d.train_split, tfds_data_dir=data_dir, text_key=text_key)
  return {"documents": meta["documents"], "tokens": meta["tokens"], "source": spec,
          "files": f"{out}/tokens-*.array_record", "seconds": time.time() - t}


def main(argv=None):
  args = parse_args(argv)
  if args.verdict:
    done = json.load(open(args.json))
    return print(table(done["arms"], done["base"]) + "\n\nverdict:\n"
                 + "\n".join(verdict(done["arms"])))
  os.makedirs(args.root, exist_ok=True)
  t0 = time.time()
  snap_wd, base_wd, source_step = distill_heads.make_base(args.source, args.root)
  corpus = validation.resolve(config_lib.load_json(os.path.join(base_wd, "config.json")))
  results = {"source": args.source, "source_step": source_step, "args": vars(args),
             "seed_changes": SEED_CHANGES, "objectives": OBJECTIVES,
             "eval_corpus": f"{corpus.data.corpus}, validation split, for every model (the "
                            "distilled runs' own summary_eval is on distilled data)",
             "greedy_identical_to_plain": "asserted for every model and batch size"}
  if "distilled" in args.data:
    results["distilled"] = distilled_data(args, snap_wd, corpus)
  base_loaded, t = workdir_lib.load_workdir(base_wd), time.time()
  scorer = Scorer(base_loaded, run_config(corpus, base_wd, args, "ce", 0), args)
  key = {k: vars(args)[k] for k in ("eval_batches", "n_prompts", "decode_prompt_len", "batches",
         "decode_new_tokens", "temperature_eval", "top_p_eval", "sample_seeds", "batch_size",
         "seq_len")}
  base = results["base"] = scorer.score(base_loaded.params, f"{args.root}/base_{EVAL_FILE}", key)
  base["eval"]["head1_loss_minus_base"] = 0.0
  print(f"base scored in {time.time() - t:.0f}s: {json.dumps(flatten(base))}", flush=True)
  plan = [(o, dname, s) for s in args.seeds for dname in args.data for o in args.arms]
  runs, spent = [], []
  for i, (objective, dname, seed) in enumerate(plan):
    wd = os.path.join(args.root, f"{objective.replace('+', '_')}-{dname}-seed{seed}")
    config = run_config(corpus, base_wd, args, objective, seed,
                        results["distilled"]["files"] if dname == "distilled" else "")
    eta = f"{np.mean(spent) * (len(plan) - i):.0f}s" if spent else "after this run"
    print(f"run {i + 1}/{len(plan)} {objective} {dname} seed {seed}: elapsed "
          f"{time.time() - t0:.0f}s, ETA {eta}", flush=True)
    t = time.time()
    summary = trained_summary(config, wd)  # None: train it (or resume it)
    trained, summary = summary is None, summary or train.train(config, wd)
    train_s, loaded = time.time() - t, workdir_lib.load_workdir(wd)
    scored = scorer.score(loaded.params, os.path.join(wd, EVAL_FILE), key)
    scored["eval"]["head1_loss_minus_base"] = (scored["eval"]["head1_loss"]
                                               - base["eval"]["head1_loss"])
    runs.append({"name": f"{objective}|{dname}|seed{seed}", "objective": objective,
                 "data": dname, "seed": seed, "workdir": wd, "step": summary["step"],
                 "train_seconds": train_s if trained else None,
                 "step_seconds": step_seconds(wd, args.batch_size * args.seq_len),
                 "frozen_bit_identical": scorer.frozen_equal(loaded.params),
                 "summary_eval": {k: v for k, v in summary.items() if k.startswith("eval/")},
                 "eval": scored["eval"], "decode": scored["decode"]})
    spent += [time.time() - t] if trained else []
    print(f"  step {summary['step']}, {runs[-1]['step_seconds'] or 0:.3f} s/step, head1 loss - "
          f"base {scored['eval']['head1_loss_minus_base']:+.2e}, {time.time() - t:.0f}s: "
          + json.dumps({c: round(v["a"], 3) for c, v in scored["decode"].items()}), flush=True)
  results.update(runs=runs, arms=aggregate(runs), wall_seconds=time.time() - t0,
                 load_avg_1min_end=os.getloadavg()[0])
  results["verdict"] = verdict(results["arms"])
  common.write_json(results, args.json, indent=1)
  plot(results["arms"], base, png := os.path.splitext(args.json)[0] + ".png")
  print(table(results["arms"], base) + "\n\nverdict:\n" + "\n".join(results["verdict"]))
  print(f"json: {args.json}\npng: {png}\nwall: {results['wall_seconds']:.0f}s")


if __name__ == "__main__":
  main()
