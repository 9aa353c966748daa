"""The name a model tensor is stored under: itself, or with transformers' renamings undone.

transformers 5 loads some checkpoints under other names than they were saved with (Bailing's
`.attention.` became `.self_attn.`, then `.self_attn.forget_gate.`). Its conversion mapping says so,
as (stored pattern, model pattern) pairs, some of them written as regexes for what are plain names
(escaped dots, a `^` anchor). Only plain renamings can be undone by replacement; the rest are converters
(`converted.py`).
"""

from __future__ import annotations

import re

from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming

from cpcompose.integrations.transformers.weights.index import StoredTensor

__all__ = ["Renamings", "is_literal", "plain_pattern", "stored_name", "transformers_conversions"]

Renamings = list[tuple[str, str]]
"""(stored, model) substrings, in transformers' order."""

_LITERAL = re.compile(r"^[A-Za-z0-9_.]+$")  # a pattern with no regex syntax: renamed by plain replacement


def is_literal(pattern: str) -> bool:
    """Whether `pattern` (a plain one) names tensors without regex syntax, so plain replacement renames it."""
    return _LITERAL.match(pattern) is not None


def plain_pattern(pattern: str) -> str:
    """A source pattern with its escaped dots unescaped and its start anchor dropped (`^model\\.word_embeddings`
    -> `model.word_embeddings`): transformers writes some literal names as regexes."""
    return pattern.removeprefix("^").replace("\\.", ".")


def transformers_conversions(model: nn.Module) -> tuple[Renamings, list[WeightConverter]]:
    """transformers' renamings (plain ones, as (stored, model) substrings) and converters for `model`."""
    if not isinstance(model, PreTrainedModel):
        return [], []
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renames = [(plain_pattern(t.source_patterns[0]), t.target_patterns[0]) for t in transforms
               if isinstance(t, WeightRenaming) and len(t.source_patterns) == 1
               and is_literal(plain_pattern(t.source_patterns[0])) and is_literal(t.target_patterns[0])]
    return renames, [t for t in transforms if isinstance(t, WeightConverter)]


def stored_name(name: str, stored: dict[str, StoredTensor], renames: Renamings) -> str | None:
    """The name `name` is stored under: itself, or with transformers' renamings undone (several may apply in
    turn: Bailing's `.attention.f_proj` -> `.self_attn.f_proj` -> `.self_attn.forget_gate.f_proj`)."""
    candidates = [name]
    for _ in range(3):  # the deepest chain transformers 5.24 writes is 2
        for candidate in candidates:
            if candidate in stored:
                return candidate
        candidates = [c.replace(target, source) for c in candidates for source, target in renames if target in c]
    return next((c for c in candidates if c in stored), None)
