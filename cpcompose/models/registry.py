"""``model.name`` -> :class:`ModelSpec`: the one place the trainer looks a model family up.

A new family is a folder next to ``llama/`` (its model, its plan, and a ``SPEC``) plus one
entry in ``_FAMILIES`` below.
"""

from __future__ import annotations

from types import MappingProxyType

from cpcompose.models import llama
from cpcompose.models.spec import ModelSpec

__all__ = ["get_model_spec", "model_names"]

_FAMILIES = MappingProxyType({spec.name: spec for spec in (llama.SPEC,)})


def model_names() -> tuple[str, ...]:
    """Every registered ``model.name``."""
    return tuple(_FAMILIES)


def get_model_spec(name: str) -> ModelSpec:
    """The family registered as ``name``.

    Raises:
        ValueError: no family has that name; the message lists those that do.
    """
    if name not in _FAMILIES:
        raise ValueError(f"model.name: {name!r} is not one of {', '.join(_FAMILIES)}")
    return _FAMILIES[name]
