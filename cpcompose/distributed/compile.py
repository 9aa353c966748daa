"""``torch.compile`` of the modules a model family chooses."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = ["apply_compile"]


def apply_compile(modules: Iterable[nn.Module], *, backend: str | Callable[..., Any] = "inductor") -> None:
    """Compile each module in place (``nn.Module.compile``), keeping its FQNs and type.

    Compilation happens lazily at the first forward. ``fullgraph=True``: a graph break
    is an error, not a silent fall back to eager, so a compiled block is compiled
    whole. CP attention inside needs nothing: under dynamo it is one custom op.

    Args:
        modules: the modules to compile, e.g. each transformer block.
        backend: torch.compile's backend (tests use "aot_eager": AOTAutograd without inductor's code generation).
    """
    for module in modules:
        module.compile(fullgraph=True, backend=backend)
