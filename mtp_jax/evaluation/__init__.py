"""Evaluation: HumanEval / MBPP pass@k (passk, the `python -m mtp_jax.evaluate` CLI), their
problems (code_tasks), the sandbox that runs model-written programs, scoring, and the small-task
scores (tasks_eval)."""
