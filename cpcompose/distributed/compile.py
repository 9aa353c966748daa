"""``torch.compile`` of the modules a model family chooses."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["apply_compile"]


def apply_compile(modules: Iterable[nn.Module]) -> None:
    """Compile each module in place (``nn.Module.compile``), keeping its FQNs and type.

    Compilation happens lazily at the first forward. The caller picks the modules:
    a family's plan leaves out whatever communicates (CP attention), which stays eager.

    Args:
        modules: the modules to compile, e.g. each block's feed-forward.
    """
    for module in modules:
        module.compile()
