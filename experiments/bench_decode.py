"""Self-speculative decoding against plain decoding on held-out code: chains, trees and the
cost model's own choice side by side; a, T1, Tc, S, greedy and sampled.

    python experiments/bench_decode.py --workdir DIR --json out/bench_decode.json [--png_dir out] \\
        [--variants "chain:4 tree:4,2,1 auto auto_tree"] [--reps 3]

Prompts are windows of real code from the validation split (files the model never trained on).
For every batch size and prompt length, plain decoding (head 1 only) and each variant generate
the same number of tokens per row (EOS ignored, so the work is fixed), each compiled ahead of
time (`decode.Decoder`, compile seconds recorded), warmed up by one call of its own, then timed
--reps times (calls of all variants interleaved); greedily, and (unless --temperature 0)
sampled with --temperature / --top_p / --top_k, where speculative sampling is distributed as
plain sampling but its tokens differ; sampled rounds rotate the seed (round i: seed i + 1, the
same for every variant), so a sampled S and a are the shape's over draws (`--seeds fixed`: seed
0 in every call, as grids before the flag; `seeds` in each sampled record). Variants: `chain:K`
(heads 1..K, `chain:all`), `tree:SPEC` (a static spec such as 4,2,1, or dynamic:N; greedy and
sampled), `auto` (--heads auto: the k the cost model picks for the cell), `auto_tree` (--heads
auto --tree auto). Each record:

  variant, heads, tree   what ran (auto: what it chose; `auto` holds its probe and table)
  a            mean tokens gained per verification forward, over rows and cycles
  a_batch      plain forwards / speculative forwards: what the slowest row allows the batch
               (sampled with rotated seeds: a and a_batch the timed rounds' means)
  T1           plain seconds per forward inside the loop (= per token of every row)
  Tc           speculative seconds per cycle inside the loop (one forward over k tokens/nodes)
  S_measured   median plain seconds / median variant seconds, same tokens; S_band: the lowest
               and highest ratio of any two timed calls; verdict: faster / slower / about the
               same (the band holds 1); S_ci: the 95% bootstrap interval of the median of the
               calls' paired ratios (`speed.paired_ci`), S_ci_within_10pct whether it is
               within +-10% of S_measured (enough timed calls: --reps)
  auto_decision_seconds, auto_decision_seconds_cached   auto only: what choosing took on a cold
               timing cache (a fresh directory: probes and timed forwards) and again on the
               same cache, warm (a new session reading it); S_with_decision(_cached): median
               plain seconds / (median auto seconds + that decision), S counting the decision
  S_predicted_auto, off_by_auto   auto only: what it predicted (where it bet: a probe its
               choice did not use, `session.HELD_OUT`) and that over S_measured - 1;
               S_chosen_auto: where it bet, the S its choice read
  S_predicted  a_batch * T1_fwd / Tk_fwd: the cost model, from a one-token and a k-token (tree:
               N-node) cached forward timed on their own, outside any loop (the in-loop
               a * T1 / Tc would equal S_measured by construction)
  off_by       S_predicted / S_measured - 1
  cycle_overhead_seconds   Tc - Tk_fwd: what a cycle costs beyond its forward (acceptance,
               sampling, drafting, cache bookkeeping); plain_overhead_seconds: T1 - T1_fwd
  identical    greedy rows: every row's output equals greedy's (sampled rows: null)

  alpha_by_position   P(draft j accepted | drafts < j accepted), measured while decoding (by
               depth, for a tree); acceptance_by_position: P(at least j drafts accepted)
  a_estimate_teacher_forced   chains: 1 + alpha_2 + alpha_2 alpha_3 + ... (Leviathan et al.)
               from the teacher-forced alpha_k of this mode, set beside the measured a: an
               estimate, not a bound (the measured a can exceed it; mtp_jax.acceptance)

Also (`teacher_forced`, in every record and the first line): on the same held-out text, the
agreement of head k with head 1 and the per-position alpha_k greedy and sampled (mtp_jax.acceptance:
what training's evals log; loops in free generation cannot flatter them).

<json>_calibration.json (`calibration`): per mode, auto against each cell's best variant, and
auto's own prediction for every candidate it weighed that also ran as a fixed variant, against
the clock (`candidates`, `candidates_within_15pct` of `candidates_compared`; the same for those
it predicted to beat plain decoding: `predicted_speculation[_within_15pct]`); for the candidates
auto did not time (their bound could not win), the bound against the clock (`bounds`,
`bounds_held` of `bounds_compared`).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: the CPU defaults (docs/cpu_speed.md)
  from mtp_jax.backends.cpu import runtime
  runtime.apply_cpu_defaults()

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np

from mtp_jax.decoding import decode as decode_lib
from mtp_jax import acceptance, train
from mtp_jax import steps as steps_lib
from experiments import common
from experiments.decode_calibration import calibration
from mtp_jax.decoding import speed, timing_cache
from mtp_jax.data import corpus
from mtp_jax.workdir import load_workdir


def heldout_prompts(loaded, n: int, length: int, seed: int = 0) -> list[np.ndarray]:
  """n windows of `length` tokens from validation files long enough to hold them."""
  source = corpus.load_source(loaded.config.data, "validation")
  docs = [loaded.tokenizer.encode(corpus.record_text(source[i])) for i in range(len(source))]
  docs = [d for d in docs if len(d) >= length + 1]
  if not docs:
    raise ValueError(f"--prompt_lens: no validation file has {length} tokens")
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    d = docs[rng.integers(len(docs))]
    start = rng.integers(0, len(d) - length)
    out.append(d[start:start + length])
  return out


def teacher_forced(loaded, batches: int = 4) -> dict:
  """On validation text (`train.validation_metrics`): head k's argmax against head 1's at the
  same target ("agreement", per head), and alpha_k greedy and sampled with the a they estimate."""
  m = train.validation_metrics(jax.jit(steps_lib.make_eval_step(loaded.model, loaded.config)),
                               loaded.params, loaded.config, None, batches=batches)
  return {"agreement": np.asarray(m["head_agree"]).round(4).tolist(),
          **acceptance.from_metrics(m)}


def parse_variants(text: str, n_future: int) -> list[dict]:
  """"chain:4 tree:4,2,1 auto auto_tree" -> [{"name", "k", "tree"}]; one error naming the flag."""
  out = []
  for v in text.split():
    kind, _, arg = v.partition(":")
    if kind == "chain" and (arg == "all" or arg.isdigit()):
      k = n_future if arg == "all" else int(arg)
      out.append({"name": f"chain:{k}", "k": k, "tree": None})
    elif kind == "tree" and arg:
      out.append({"name": v, "k": None, "tree": arg})
    elif v in ("auto", "auto_tree"):
      out.append({"name": v, "k": "auto", "tree": "auto" if v == "auto_tree" else None})
    else:
      raise SystemExit(f"error: --variants: {v!r} is not chain:K, chain:all, tree:SPEC, auto or "
                       "auto_tree")
  return out


def run_cell(loaded, prompts, variants, max_new, reps, sample_kw=None, rotate_seeds=False):
  """Plain decoding (k = 1) against each variant on the same prompts, every one timed after its
  own warm-up, `reps` times interleaved; sample_kw: sampling arguments (None: greedy);
  rotate_seeds: sampled rounds decode with seeds seed + 1, seed + 2, ... (every variant alike
  within a round), so S and a are the shape's over draws, not one seed's. Returns one record per
  variant (without the cell's batch / prompt fields)."""
  args = loaded.model.args
  shape = dict(batch=len(prompts), prompt_len=max(len(p) for p in prompts),
               max_new_tokens=max_new, sampling=bool(sample_kw))
  ids = dict(eos_id=-1, pad_id=loaded.tokenizer.pad_id, **(sample_kw or {}))
  decoders = {"plain": (decode_lib.Decoder(loaded.params, args, k=1, **shape), None)}
  # auto's choice runs the chosen variant's own decoder where there is one: two compilations of
  # one program can run up to 17% apart on a 2-core VM, which would judge the executable
  built = {(1, "None"): decoders["plain"][0]}
  for v in variants:
    with tempfile.TemporaryDirectory() as d:  # auto: a cold timing cache, then the same warm
      disk, seconds = timing_cache.DiskCache(d), []
      for _ in range(2 if v["k"] == "auto" or v["tree"] == "auto" else 1):
        t0 = time.perf_counter()
        k, tree, auto = decode_lib.resolve(loaded.params, args, prompts, max_new_tokens=max_new,
                                           k=v["k"], tree=v["tree"], disk=disk, **ids)
        seconds.append(time.perf_counter() - t0)
    if auto:
      auto.update(decision_seconds=seconds[0], decision_seconds_cached=seconds[-1])
    key = (k, str(tree))
    if key not in built:
      built[key] = decode_lib.Decoder(loaded.params, args, k=k, tree=tree, **shape)
    decoders[v["name"]] = (built[key], auto)
  seed = {"now": ids.get("seed", 0)}  # auto decided on the seed given, as a caller's call would
  rotate = bool(sample_kw) and rotate_seeds
  timed = speed.time_modes({name: (lambda d=d: d(prompts, **dict(ids, seed=seed["now"])) if
                                   sample_kw else d(prompts, **ids))
                            for name, (d, _) in decoders.items()}, reps,
                           on_round=(lambda i: seed.update(now=ids["seed"] + 1 + i)) if rotate
                           else None)
  g = timed["plain"]["result"]
  T1 = g.seconds / g.forwards
  records = []
  for name, (dec, auto) in decoders.items():
    if name == "plain":
      continue
    s = timed[name]["result"]
    cmp = speed.compare(timed["plain"]["seconds"], timed[name]["seconds"])
    records.append({
        "mode": "sampled" if sample_kw else "greedy", "variant": name,
        "sampling": sample_kw or None, "heads": s.heads, "tree": s.tree, "auto": auto,
        "a": (float(np.mean(timed[name]["tokens_per_forward"])) if rotate
              else s.tokens_per_forward),
        # what the slowest row allows the whole batch (with rotated seeds: the rounds' mean)
        "a_batch": (float(np.mean(np.divide(timed["plain"]["forwards"],
                                            timed[name]["forwards"])))
                    if rotate else g.forwards / s.forwards),
        "seeds": "rotated" if rotate else "fixed" if sample_kw else None,
        "acceptance_by_position": s.acceptance_by_position().tolist(),
        "alpha_by_position": s.alpha_by_position().round(4).tolist(),
        "T1": T1, "Tc": s.seconds / s.forwards, "Tc_over_T1": s.seconds / s.forwards / T1,
        "S_measured": cmp["speedup"], "S_band": cmp["band"], "verdict": cmp["verdict"],
        "S_ci": cmp["ci"],  # 95% interval of the median paired ratio
        "S_ci_within_10pct": bool(cmp["ci"][0] >= 0.9 * cmp["speedup"]
                                  and cmp["ci"][1] <= 1.1 * cmp["speedup"]),
        "identical": (bool(np.array_equal(g.tokens, s.tokens)
                           and np.array_equal(g.lengths, s.lengths)) if not sample_kw else None),
        "greedy_seconds": float(np.median(cmp["base_seconds"])),  # plain decoding (k = 1)
        "speculative_seconds": float(np.median(cmp["seconds"])),
        "greedy_seconds_all": cmp["base_seconds"], "speculative_seconds_all": cmp["seconds"],
        "greedy_forwards": g.forwards, "speculative_forwards": s.forwards,
        "tokens_per_row": max_new, "reps": reps,
        "greedy_compile_seconds": decoders["plain"][0].compile_seconds,
        "speculative_compile_seconds": dec.compile_seconds,
        "_tree": dec.tree,
    })
    if auto:  # auto's decision (probe and timings) on a cold cache, and on the same warm one
      base, spec = records[-1]["greedy_seconds"], records[-1]["speculative_seconds"]
      records[-1].update(auto_decision_seconds=auto["decision_seconds"],
                         auto_decision_seconds_cached=auto["decision_seconds_cached"],
                         S_with_decision=base / (spec + auto["decision_seconds"]),
                         S_with_decision_cached=base / (spec + auto["decision_seconds_cached"]))
  return records


def plots(records, png_dir, prefix="decode_"):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  # the speed-up plot: the greedy cells, or the sampled ones of a grid without them (--modes)
  shown = "greedy" if any(r.get("mode", "greedy") == "greedy" for r in records) else "sampled"
  greedy = [r for r in records if r.get("mode", "greedy") == shown]
  os.makedirs(png_dir, exist_ok=True)
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  for ax, mode in zip(axes, ("greedy", "sampled")):
    for r in records:  # measured alpha_k (solid), teacher-forced (dashed), batch-1 chains
      if r.get("mode", "greedy") != mode or r["batch"] != 1 or r["tree"] is not None:
        continue
      alpha = r.get("alpha_by_position") or acceptance.conditional(r["acceptance_by_position"])
      if len(alpha) == 0:  # plain decoding (auto's choice): no drafts
        continue
      pos = np.arange(2, len(alpha) + 2)
      line, = ax.plot(pos, alpha, "o-", label=f"{r['variant']}, prompt {r['prompt_len']}")
      tf = (r.get("teacher_forced") or {}).get(f"alpha_{mode}")
      if tf:
        ax.plot(pos, tf[:len(alpha)], "x--", color=line.get_color(), label="teacher-forced")
      ax.set_xticks(pos)
    ax.set(xlabel="head (draft position)", ylabel="P(draft k accepted | drafts < k)",
           ylim=(0, 1), title=f"alpha_k, batch 1 ({mode})")
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(os.path.join(png_dir, f"{prefix}acceptance.png"), dpi=120)
  plens = sorted({r["prompt_len"] for r in greedy})
  fig, axes = plt.subplots(1, len(plens), figsize=(5 * len(plens), 3.5), squeeze=False)
  for ax, plen in zip(axes[0], plens):
    for variant in dict.fromkeys(r["variant"] for r in greedy):
      rs = sorted((r for r in greedy if r["prompt_len"] == plen and r["variant"] == variant),
                  key=lambda r: r["batch"])
      line, = ax.plot([r["batch"] for r in rs], [r["S_measured"] for r in rs], "o-",
                      label=f"{variant}: S measured")
      ax.fill_between([r["batch"] for r in rs], [r["S_band"][0] for r in rs],
                      [r["S_band"][1] for r in rs], color=line.get_color(), alpha=0.15)
      ax.plot([r["batch"] for r in rs], [r["S_predicted"] for r in rs], "x--",
              color=line.get_color(), label=f"{variant}: a*T1/Tk predicted")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xscale="log", xlabel="batch size", ylabel="speed-up over greedy",
           title=f"{shown.capitalize()}, prompt {plen} (band: noise of the timed calls)")
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(os.path.join(png_dir, f"{prefix}speedup.png"), dpi=120)


def write_calibration(records, json_path, machine=None) -> dict:
  """Prints the grid's calibration, each mode's verdicts first, and writes it beside the
  records' JSON (`<json>_calibration.json`) where there is one."""
  cal = calibration(records)
  for mode, c in cal.items():
    if c.get("judged"):
      print(f"{mode}: auto against the best variant {c['judged']} (the best chosen on the "
            f"other rounds: {c['judged_crossfit']}); the cost model where auto bet "
            f"{c['cost_model_judged']}", flush=True)
  print(json.dumps({"calibration": cal}), flush=True)
  if json_path:
    if machine:
      cal["machine"] = machine
    with open(os.path.splitext(json_path)[0] + "_calibration.json", "w") as f:
      json.dump(common.stamp(cal), f, indent=2)
  return cal


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", default=None)
  ap.add_argument("--json", default=None)
  ap.add_argument("--png_dir", default=None, help="default: the folder of --json")
  ap.add_argument("--png_prefix", default=None,
                  help="PNG names: PREFIXspeedup.png, ...; default: the --json (--replot) file's "
                       "name and _ (decode_ without one), so a run never overwrites another's")
  ap.add_argument("--replot", default=None,
                  help="a JSON this script wrote: its calibration and plots again, no decoding")
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--prompt_lens", default="64,256")
  ap.add_argument("--max_new_tokens", type=int, default=128)
  ap.add_argument("--variants", default="chain:all tree:4,2,1 auto",
                  help="space-separated: chain:K, chain:all, tree:SPEC, auto, auto_tree")
  ap.add_argument("--reps", type=int, default=speed.REPS, help="timed calls per variant (>= 3)")
  ap.add_argument("--temperature", type=float, default=0.8, help="sampled rows; 0: greedy only")
  ap.add_argument("--modes", default="greedy,sampled", help="greedy, sampled or both, comma-"
                  "separated (sampled with --temperature > 0)")
  ap.add_argument("--seeds", default="rotate", help="sampled cells: rotate (round i decodes "
                  "with seed i + 1, every variant alike: S over draws) or fixed (seed 0 in every "
                  "call, as grids before this flag)")
  ap.add_argument("--top_p", type=float, default=0.95)
  ap.add_argument("--top_k", type=int, default=0)
  args = ap.parse_args(argv)
  if args.png_prefix is None:
    named = args.replot or args.json
    args.png_prefix = (os.path.splitext(os.path.basename(named))[0] + "_" if named
                       else "decode_")
  if os.sep in args.png_prefix:
    raise SystemExit(f"error: --png_prefix: a file name prefix, not a path, got "
                     f"{args.png_prefix!r} (the folder is --png_dir)")
  if args.replot:
    with open(args.replot) as f:
      records = json.load(f)
    if records:  # the calibration again, from the records (its machine theirs, not this one's)
      write_calibration(records, args.replot, machine=records[0].get("machine"))
    plots(records, args.png_dir or os.path.dirname(os.path.abspath(args.replot)),
          args.png_prefix)
    return
  wanted = args.modes.split(",")
  if set(wanted) - {"greedy", "sampled"} or ("greedy" not in wanted and args.temperature <= 0):
    # an error only where nothing would run: with temperature 0 both modes run greedy alone
    raise SystemExit(f"error: --modes: greedy, sampled or both (sampled with --temperature > 0), "
                     f"got {args.modes!r}")
  if args.seeds not in ("rotate", "fixed"):
    raise SystemExit(f"error: --seeds: rotate or fixed, got {args.seeds!r}")
  if not args.workdir:
    raise SystemExit("error: --workdir: required (a training workdir)")
  if args.reps < speed.REPS:
    raise SystemExit(f"error: --reps: at least {speed.REPS}, got {args.reps}")
  modes = [None] if "greedy" in wanted else []
  if args.temperature > 0 and "sampled" in wanted:
    modes.append(dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=0))
  loaded = load_workdir(args.workdir)
  variants = parse_variants(args.variants, loaded.model.args.n_future)
  tf = teacher_forced(loaded)
  records = []
  print(f"step {loaded.step}, {loaded.model.args.head_kind} heads, "
        f"{args.max_new_tokens} new tokens per row, {args.reps} timed calls per variant after a "
        f"warm-up, {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}); "
        f"teacher-forced, heads 2..n: alpha greedy {tf['alpha_greedy']} (a estimated "
        f"{acceptance.estimate(tf, 'greedy')}), sampled {tf['alpha_sampled']} (a estimated "
        f"{acceptance.estimate(tf, 'sampled')})",
        flush=True)
  print("| mode | batch | prompt | variant | heads | tree | a | a est. (tf) | a (batch) | T1 ms | "
        "Tc ms | T1 fwd ms | Tk fwd ms | overhead ms | S measured (band) | S predicted | "
        "identical |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for plen in [int(x) for x in args.prompt_lens.split(",")]:
    for batch in [int(x) for x in args.batches.split(",")]:
      prompts = heldout_prompts(loaded, batch, plen)
      for sample_kw in modes:
        for r in run_cell(loaded, prompts, variants, args.max_new_tokens, args.reps, sample_kw,
                          rotate_seeds=args.seeds == "rotate"):
          cost = decode_lib.forward_seconds(loaded.params, loaded.model.args, r["heads"],
                                             batch=batch, context=plen + args.max_new_tokens // 2,
                                             tree=r.pop("_tree"))
          r.update(batch=batch, prompt_len=plen, step=loaded.step,
                   teacher_forced=tf, backend=jax.devices()[0].platform,
                   load_average=os.getloadavg()[0],
                   forward_1_seconds=cost["forward_1"], forward_k_seconds=cost["forward_k"],
                   S_predicted=r["a_batch"] * cost["forward_1"] / cost["forward_k"],
                   cycle_overhead_seconds=r["Tc"] - cost["forward_k"],
                   plain_overhead_seconds=r["T1"] - cost["forward_1"])
          r["off_by"] = r["S_predicted"] / r["S_measured"] - 1
          r["a_estimate_teacher_forced"] = (None if r["tree"] else  # first heads - 1 alphas
                          acceptance.leviathan_a(tf[f"alpha_{r['mode']}"][:r["heads"] - 1]))
          if r["auto"]:  # what auto predicted when it chose, before decoding (pessimistic a)
            r["S_predicted_auto"] = r["auto"]["S_predicted"]
            r["off_by_auto"] = r["S_predicted_auto"] / r["S_measured"] - 1
            if r["auto"].get("S_chosen"):  # a bet: the S it was chosen on, beside the held-out's
              r["S_chosen_auto"] = r["auto"]["S_chosen"]
          records.append(r)
          lo, hi = r["S_band"]
          est = r["a_estimate_teacher_forced"]
          with_decision = (f"; with deciding {r['S_with_decision']:.2f}, cached "
                           f"{r['S_with_decision_cached']:.2f}" if r["auto"] else "")
          print(f"| {r['mode']} | {batch} | {plen} | {r['variant']} | {r['heads']} | "
                f"{r['tree'] or '-'} | {r['a']:.2f} | "
                f"{'-' if est is None else format(est, '.2f')} | "
                f"{r['a_batch']:.2f} | "
                f"{1e3 * r['T1']:.1f} | {1e3 * r['Tc']:.1f} | {1e3 * cost['forward_1']:.1f} | "
                f"{1e3 * cost['forward_k']:.1f} | {1e3 * r['cycle_overhead_seconds']:.1f} | "
                f"{r['S_measured']:.2f} ({lo:.2f}-{hi:.2f}; 95% ci {r['S_ci'][0]:.2f}-"
                f"{r['S_ci'][1]:.2f}){with_decision} | "
                f"{r['S_predicted']:.2f} | "
                f"{r['identical']} |", flush=True)
        if args.json:  # after every cell: a long grid cut short keeps what it measured
          os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
          with open(args.json, "w") as f:
            json.dump(common.stamp(records), f, indent=2)
  write_calibration(records, args.json)
  png_dir = args.png_dir or (os.path.dirname(os.path.abspath(args.json)) if args.json else None)
  if png_dir:
    plots(records, png_dir, args.png_prefix)


if __name__ == "__main__":
  main()
