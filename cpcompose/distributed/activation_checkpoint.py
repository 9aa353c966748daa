"""Full activation checkpointing of chosen blocks, without changing their names or types.

With `offload=True` each checkpointed block's saved inputs (all a checkpoint keeps of a block
between forward and backward) go to pinned host memory as they are saved, and come back to the
GPU when backward recomputes the block: PyTorch's `save_on_cpu` around the checkpointed call.
Non-reentrant checkpointing saves its inputs through the saved-tensor hooks that are active
outside it, while its own hooks handle everything inside the block, so only the block inputs
move. Exact: the same values, copied out and back. On the CPU there is nowhere to move them, so
offload changes nothing there (no copy is made).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "offloaded_saved_inputs"]


def offloaded_saved_inputs(*args: Any) -> contextlib.AbstractContextManager:
    """`save_on_cpu(pin_memory=True)` when a tensor in `args` is on CUDA; a no-op context otherwise.

    Decided per call from the inputs, so one model object runs on either device without a setting.
    """
    if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()


class _CheckpointedForward:
    """Mixin: run the class's forward under non-reentrant activation checkpointing."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)  # type: ignore[misc]


class _OffloadedCheckpointedForward:
    """Mixin: the same, with the checkpoint's saved inputs in host memory (on CUDA)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with offloaded_saved_inputs(*args, *kwargs.values()):
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)  # type: ignore[misc]


@functools.cache
def _checkpointed_class(cls: type, offload: bool) -> type:
    # One subclass per block class (and offload choice), so every block of a model shares it.
    mixin = _OffloadedCheckpointedForward if offload else _CheckpointedForward
    return type(f"{'Offloaded' if offload else ''}Checkpointed{cls.__name__}", (mixin, cls), {})


def apply_activation_checkpointing(blocks: Iterable[nn.Module], *, offload: bool = False) -> None:
    """Make each block recompute its forward during backward, in place.

    The class is swapped (as ``fully_shard`` does) instead of wrapping the module,
    so FQNs, state dicts and ``isinstance`` checks stay as they are. Hooks installed
    inside a block (such as ``ContextParallel``'s) fire again during the recompute,
    so CP attention communicates again there too. Applying it twice is harmless
    (the first choice of ``offload`` stays).

    Args:
        blocks: the modules to checkpoint, e.g. every transformer block.
        offload: keep each block's saved inputs in pinned host memory between forward and
            backward when they are CUDA tensors (see the module docstring); on the CPU it
            changes nothing.
    """
    for block in blocks:
        if not isinstance(block, (_CheckpointedForward, _OffloadedCheckpointedForward)):
            block.__class__ = _checkpointed_class(type(block), offload)
