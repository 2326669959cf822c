"""Instruct models scored through their chat template, as EvalPlus scores them
(`evaluate --prompt_format chat`): the task's prompt goes into a user message asking for a
self-contained script in a Markdown code block; the model's reply is started for it (EvalPlus's
response prefix and an opening ```python fence), so what it decodes is code up to the closing
fence. The program run is that code and the task's tests, with the prompt's own imports put
first (a script that leaves out `from typing import List` still runs); a reply that does not
define a function is taken as the body of the prompt's, as in raw mode.

The template is the workdir's chat_template.jinja (written by `convert from-gguf` / `from-hf`),
rendered as transformers renders it: a sandboxed Jinja2 environment with trim_blocks and
lstrip_blocks, messages, add_generation_prompt=True and the tokenizer's bos and eos tokens."""

from __future__ import annotations

import dataclasses
import os
import re

from mtp_jax.evaluation import code_tasks

TEMPLATE_FILE = "chat_template.jinja"
# EvalPlus's instruction and response prefixes (evalplus/codegen.py), word for word.
INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem "
               "in a markdown code block:")
RESPONSE = ("Below is a Python script with a self-contained function that solves the problem "
            "and passes corresponding tests:")
FENCE = "```"
_DEF = re.compile(r"^(?:async\s+)?def\s+\w+", re.M)
_IMPORT = re.compile(r"^(?:import|from)\s+\S", re.M)


@dataclasses.dataclass(frozen=True)
class ChatProblem(code_tasks.Problem):
  """A task whose prompt is the rendered chat (the model's reply begun) and whose completion is
  the reply's code up to the closing fence; `source` is the task's own prompt."""
  source: str = ""

  def program(self, completion: str) -> str:
    if not _DEF.search(completion):  # not a script: the body of the prompt's function
      return self.source + completion + "\n" + self.test
    imports = "".join(line + "\n" for line in self.source.splitlines() if _IMPORT.match(line))
    return imports + completion + "\n" + self.test


def template(workdir: str) -> str:
  """The workdir's chat template, or one ValueError naming --prompt_format."""
  path = os.path.join(workdir, TEMPLATE_FILE)
  if not os.path.isfile(path):
    raise ValueError(f"--prompt_format: chat needs the model's chat template, and {workdir} has "
                     f"no {TEMPLATE_FILE} (convert from-gguf / from-hf write it where the model "
                     "has one); use --prompt_format raw")
  with open(path) as f:
    return f.read()


def render(source: str, messages: list[dict], bos_token: str = "", eos_token: str = "") -> str:
  """The template applied as transformers' apply_chat_template(tokenize=False,
  add_generation_prompt=True) applies it."""
  from jinja2.exceptions import TemplateError
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = raise_exception
  return env.from_string(source).render(messages=messages, add_generation_prompt=True,
                                        bos_token=bos_token, eos_token=eos_token)


def problem(p: code_tasks.Problem, source: str, bos_token: str = "",
            eos_token: str = "") -> ChatProblem:
  """`p` as a chat: the user message holds its prompt, the reply is begun with EvalPlus's
  response prefix and a ```python fence, and the completion stops at the closing fence."""
  user = f"{INSTRUCTION}\n{FENCE}\n{p.prompt.strip()}\n{FENCE}\n"
  text = render(source, [{"role": "user", "content": user}], bos_token, eos_token)
  return ChatProblem(p.task_id, text + f"{RESPONSE}\n{FENCE}python\n", p.test, p.canonical,
                     (FENCE,), source=p.prompt)


def encode_problems(problems: list, tok, chat_template: str | None, add_bos: bool = False):
  """(problems, prompt ids) as `evaluate` decodes them: with `chat_template`, each problem as a
  chat (`problem`, the template saying where bos goes); bos added where `add_bos` asks or the
  tokenizer's own template starts with it (a Llama 3 tokenizer.json) outside a chat. A prompt
  that cannot be encoded is one ValueError naming --task."""
  if chat_template is not None:
    problems = [problem(p, chat_template, tok.token(tok.bos_id) or "", tok.token(tok.eos_id) or "")
                for p in problems]
  add_bos = add_bos or (getattr(tok, "prompt_bos", False) and chat_template is None)
  prompts = []
  for p in problems:
    try:
      prompts.append(tok.encode(p.prompt, add_bos=add_bos))
    except ValueError as e:
      raise ValueError(f"--task: prompt of {p.task_id} cannot be encoded: {e}") from None
  return problems, prompts
