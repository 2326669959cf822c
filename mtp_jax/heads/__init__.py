"""Prediction heads, chosen by `config.model.heads.kind` from a registry.

A kind is one `HeadKind` subclass under `@register(name)`, in a file of its own here: its flax
`__call__`, and the class attributes and methods through which the rest of the code sees it
(trunk blocks it leaves, KV cache blocks when decoding, which stacked params hold which head,
its config fields' choices and presets, warm start, FLOPs per token, its two decoding phases
(`Shared.phase`), whether it drafts trees, the released checkpoint layouts it holds). Nothing
outside this package names a kind (tests/test_layout.py checks). `base` holds the registry and
what every kind shares; importing the package registers the built-in kinds.
"""

from mtp_jax.heads.base import (KINDS, PHASES, Drafting, HeadKind, Shared, head_logits,
                                layout_kind, preset_values, register, slice_params, tree_kinds,
                                unregister)
from mtp_jax.heads.parallel import ParallelHeads
from mtp_jax.heads.projection import ProjectionHeads
from mtp_jax.heads.sequential import SequentialHeads

__all__ = ["KINDS", "PHASES", "Drafting", "HeadKind", "Shared", "head_logits", "layout_kind",
           "preset_values", "register", "slice_params", "tree_kinds", "unregister", "ParallelHeads",
           "ProjectionHeads", "SequentialHeads"]
