"""Full activation checkpointing of chosen blocks, without changing their names or types."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


class _CheckpointedForward:
    """Mixin: run the class's forward under non-reentrant activation checkpointing."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)  # type: ignore[misc]


@functools.cache
def _checkpointed_class(cls: type) -> type:
    # One subclass per block class, so every block of a model shares it.
    return type(f"Checkpointed{cls.__name__}", (_CheckpointedForward, cls), {})


def apply_activation_checkpointing(blocks: Iterable[nn.Module]) -> None:
    """Make each block recompute its forward during backward, in place.

    The class is swapped (as ``fully_shard`` does) instead of wrapping the module,
    so FQNs, state dicts and ``isinstance`` checks stay as they are. Hooks installed
    inside a block (such as ``ContextParallel``'s) fire again during the recompute,
    so CP attention communicates again there too. Applying it twice is harmless.

    Args:
        blocks: the modules to checkpoint, e.g. every transformer block.
    """
    for block in blocks:
        if not isinstance(block, _CheckpointedForward):
            block.__class__ = _checkpointed_class(type(block))
