"""Benchmarks and studies: each module is a script that prints JSON (`python -m experiments.X`
from the repository root, or `python experiments/X.py` with the repository importable: the
editable install or PYTHONPATH=.). Shared setup is in common.py."""
