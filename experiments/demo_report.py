"""The closing report of `make demo-scratch`: what the model learned and what its heads buy, from
the files the demo wrote (nothing is recomputed here).

    python experiments/demo_report.py --workdir runs/demo --decode_json runs/demo/decode.json

- held-out loss and accuracy per head (summary.json, the last eval on the validation split);
- teacher-forced acceptance alpha_k on held-out text, greedy and sampled (mtp_jax.acceptance:
  P(draft k accepted | drafts < k accepted)), and the tokens per cycle they give, what free
  generation's loops cannot flatter (older runs: head k's agreement with head 1);
- decoding on held-out windows (experiments/bench_decode.py's JSON), per variant (a chain of
  all heads, a tree, the cost model's own choice of k): tokens per forward a, the speed-up S
  measured against plain decoding (medians of timed calls after a warm-up each, with the noise
  band of those calls: a band holding 1 reads "about the same"), and the cost model's verdict
  for this machine: S = a x T1/Tk, with T1 and Tk a one-token and a k-token forward timed on
  their own, so speculation pays where a > Tk/T1;
- where speculation pays: the best S measured here, the cost model's verdict for this machine,
  and XLA:TPU's compile-time estimate of S on one v5e chip for this model's shape and the a
  measured here (experiments/results/aot_decode_v5e_default.json, bench_accel.py --target
  tpu:v5e:2x2 --sizes default: the compiler's roofline T1 and Tk, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os

AOT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        "aot_decode_v5e_default.json")


def _heads(summary: dict, metric: str) -> list[float]:
  out, i = [], 1
  while f"eval/head{i}_{metric}" in summary:
    out.append(summary[f"eval/head{i}_{metric}"])
    i += 1
  return out


def _estimate(summary: dict, mode: str) -> float:
  """The teacher-forced estimate of a (mtp_jax.acceptance.ESTIMATE), or its old name's value."""
  return summary.get(f"eval/a_estimate_teacher_forced_{mode}", summary.get(f"eval/a_bound_{mode}"))


def _fmt(values, digits: int = 3) -> str:
  return "  ".join(f"{v:.{digits}f}" for v in values)


def report(summary: dict, rows: list[dict], aot: dict | None = None) -> str:
  lines = []
  tokens = summary.get("tokens_seen", 0)
  lines.append(f"== the model: step {summary['step']}, {tokens:,} training tokens, "
               f"{summary['n_params']:,} params, {summary['n_future']} {summary['head_kind']} "
               "heads ==")
  loss, acc, agree = _heads(summary, "loss"), _heads(summary, "acc"), _heads(summary, "agree")
  if loss:
    lines.append(f"held-out loss per head (nats/token): {_fmt(loss)}")
    lines.append(f"held-out accuracy per head:          {_fmt(acc)}")
    alpha = {m: _heads(summary, f"alpha_{m}")[1:] for m in ("greedy", "sampled")}
    if alpha["greedy"]:
      for m in ("greedy", "sampled"):
        lines.append(f"teacher-forced alpha_k {m}, heads 2-{len(agree)} (P(draft k accepted | "
                     f"drafts < k)): {_fmt(alpha[m])}; tokens per cycle they estimate "
                     f"{_estimate(summary, m):.2f}")
    else:
      lines.append(f"teacher-forced acceptance, heads 2-{len(agree)} (argmax equals head 1's): "
                   f"{_fmt(agree[1:])}")
  for r in rows:
    name = "greedy" if r["mode"] == "greedy" else (
        f"sampled (temperature {r['sampling']['temperature']}, top_p {r['sampling']['top_p']})")
    variant = r.get("variant", f"chain:{r['heads']}")
    what = (f"tree {r['tree']}" if r.get("tree") else f"chain of {r['heads']} heads"
            if r["heads"] > 1 else "plain decoding (head 1)")
    if variant.startswith("auto"):
      what = f"auto, chose {what} (predicted S {r['auto']['S_predicted']:.2f})"
    t1, tk = r["forward_1_seconds"], r["forward_k_seconds"]
    lines.append(f"== {name} decoding, {what}, batch {r['batch']}, held-out prompts of "
                 f"{r['prompt_len']} tokens, {r['tokens_per_row']} new tokens each ==")
    by_pos = (f"alpha_k measured {_fmt(r['alpha_by_position'], 2)}" if "alpha_by_position" in r
              else f"acceptance by draft position {_fmt(r['acceptance_by_position'], 2)}")
    lines.append(f"tokens per forward a = {r['a']:.2f} ({by_pos})"
                 + ("; identical to greedy: " + str(r["identical"]) if r["identical"] is not None
                    else ""))
    if r["heads"] > 1:
      lines.append(f"one-token forward T1 = {1e3 * t1:.2f} ms, {r['heads']}-head forward Tk = "
                   f"{1e3 * tk:.2f} ms: speculation pays where a > Tk/T1 = {tk / t1:.2f}")
    lo, hi = r.get("S_band", (r["S_measured"], r["S_measured"]))
    verdict = r.get("verdict") or ("faster" if lo > 1 else "slower" if hi < 1 else
                                   "about the same")
    verdict = "about the same as" if verdict == "about the same" else verdict + " than"
    lines.append(f"speed-up S measured {r['S_measured']:.2f} (noise band {lo:.2f}-{hi:.2f} over "
                 f"{r.get('reps', 1)} timed calls each: {verdict} plain decoding), predicted "
                 f"a x T1/Tk = {r['S_predicted']:.2f} (off by {r['off_by']:+.0%}: the loop's "
                 "acceptance and sampling work is not in the forwards)")
  return "\n".join(lines + closing(rows, aot))


def closing(rows: list[dict], aot: dict | None) -> list[str]:
  """The demo's last lines: where speculation pays, here and (by the compiler) on a TPU."""
  spec = [r for r in rows if r["heads"] > 1]
  if not spec:
    return ["== where speculation pays: auto kept plain decoding in every cell here =="]
  best = max(spec, key=lambda r: r["S_measured"])
  lo, hi = best.get("S_band", (best["S_measured"],) * 2)
  pays = [r for r in spec if r["S_predicted"] > 1]
  verdict = ("pays on this machine for " + ", ".join(f"{r.get('variant', '')} {r['mode']}"
                                                     for r in pays) if pays else
             "does not pay on this machine (a < Tk/T1 for every variant)")
  out = ["== where speculation pays ==",
         f"here ({best['mode']}, batch {best['batch']}): best S measured {best['S_measured']:.2f} "
         f"(band {lo:.2f}-{hi:.2f}, {best.get('variant', '')}); the cost model says speculation "
         + verdict]
  run = next((x for x in (aot or {}).get("runs", [])
              if x["batch"] == 1 and x.get("Tk_over_T1")), None)
  chain = [r for r in spec if run and r["mode"] == "greedy" and r["batch"] == 1
           and not r.get("tree") and r["heads"] == run["k"]]
  if chain:
    a = chain[0]["a_batch"]
    out.append(f"on one {aot['device_kind']} ({aot['compiler']}'s compile-time estimate, not "
               f"a measurement): Tk/T1 = {run['Tk_over_T1']:.2f} for this model's shape at "
               f"batch 1, so the a = {a:.2f} measured here would give S = "
               f"{a / run['Tk_over_T1']:.2f} with {run['k']} heads")
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--decode_json", required=True, help="experiments/bench_decode.py's --json")
  ap.add_argument("--aot_json", default=AOT_JSON, help="bench_accel.py --target's JSON for "
                  "this model's shape ('' : none)")
  a = ap.parse_args(argv)
  with open(os.path.join(a.workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(a.decode_json) as f:
    rows = json.load(f)
  aot = None
  if a.aot_json and os.path.isfile(a.aot_json):
    with open(a.aot_json) as f:
      aot = json.load(f)
  print(report(summary, rows, aot), flush=True)


if __name__ == "__main__":
  main()
