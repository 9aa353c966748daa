"""Full activation checkpointing of chosen blocks, without changing their names or types.

With `offload=True` each checkpointed block's saved inputs (all a checkpoint keeps of a block
between forward and backward) go to pinned host memory as they are saved, and come back to the
GPU when backward recomputes the block: `host_offload.HostOffload`'s hooks around the checkpointed
call (power-of-two pinned pieces instead of `save_on_cpu`'s one tensor rounded up to a power of two,
and a tensor object every block is handed, such as the rotary tables, copied once; one `HostOffload`
a model, shared by its blocks). Non-reentrant checkpointing saves its inputs through the saved-tensor
hooks that are active outside it, while its own hooks handle everything inside the block, so only
the block inputs move. Exact: the same values, copied out and back. On the CPU there is nowhere to
move them, so offload changes nothing there (no copy is made).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cpcompose.comm import rehearsing
from cpcompose.distributed.host_offload import HostOffload

__all__ = ["ContextFn", "apply_activation_checkpointing", "offloaded_saved_inputs"]


def offloaded_saved_inputs(*args: Any, host: HostOffload | None = None) -> contextlib.AbstractContextManager:
    """`host`'s hooks (the model's `HostOffload`; a new one if None) when a tensor in `args` is on CUDA; a no-op
    context otherwise.

    Decided per call from the inputs, so one model object runs on either device without a setting.
    In a rehearsal (`comm.rehearsal_mode`, on the CPU) the inputs leave device memory as on a GPU
    (`_as_if_saved_on_host`), so that a memory tracker counts what a GPU would hold.
    """
    if rehearsing():
        return _as_if_saved_on_host()
    if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        return (host if host is not None else HostOffload()).hooks()
    return contextlib.nullcontext()


def _as_if_saved_on_host() -> contextlib.AbstractContextManager:
    """What host offload does to device memory: the saved tensor leaves at pack, a new one is made at unpack."""

    def pack(t: torch.Tensor) -> tuple:
        return t.size(), t.stride(), t.dtype, t.device

    def unpack(saved: tuple) -> torch.Tensor:
        size, stride, dtype, device = saved
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


ContextFn = Callable[[], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]]
"""`torch.utils.checkpoint`'s `context_fn`: (context around the forward, context around the recomputation)."""


class _CheckpointedForward:
    """Mixin: run the class's forward under non-reentrant activation checkpointing."""

    _checkpoint_options: dict[str, Any] = {}  # {"context_fn": ...} when one was asked for, else torch's default

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super().forward, *args, use_reentrant=False,  # type: ignore[misc]
                          **self._checkpoint_options, **kwargs)


class _OffloadedCheckpointedForward(_CheckpointedForward):
    """Mixin: the same, with the checkpoint's saved inputs in host memory (on CUDA)."""

    _host_offload: HostOffload | None = None  # the model's, set by `apply_activation_checkpointing`

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with offloaded_saved_inputs(*args, *kwargs.values(), host=self._host_offload):
            return super().forward(*args, **kwargs)


@functools.cache
def _checkpointed_class(cls: type, offload: bool, context_fn: ContextFn | None) -> type:
    # One subclass per block class (and offload and context choice), so every block of a model shares it.
    mixin = _OffloadedCheckpointedForward if offload else _CheckpointedForward
    body = {} if context_fn is None else {"_checkpoint_options": {"context_fn": context_fn}}
    return type(f"{'Offloaded' if offload else ''}Checkpointed{cls.__name__}", (mixin, cls), body)


def apply_activation_checkpointing(
    blocks: Iterable[nn.Module], *, offload: bool = False, context_fn: ContextFn | None = None
) -> None:
    """Make each block recompute its forward during backward, in place.

    The class is swapped (as ``fully_shard`` does) instead of wrapping the module,
    so FQNs, state dicts and ``isinstance`` checks stay as they are. Hooks installed
    inside a block (such as ``ContextParallel``'s) fire again during the recompute,
    so CP attention communicates again there too. Applying it twice is harmless
    (the first choice of ``offload`` stays).

    Args:
        blocks: the modules to checkpoint, e.g. every transformer block.
        offload: keep each block's saved inputs in pinned host memory between forward and
            backward when they are CUDA tensors (see the module docstring), the blocks of one
            call sharing one `HostOffload`; on the CPU it changes nothing.
        context_fn: the checkpoint's `context_fn`, for models whose CP lives in a region rather
            than in hooks: `cpcompose.parallel.recompute_context` re-enters the region the forward
            ran in around the recomputation (a Hugging Face model under `context_parallel`).
    """
    host = HostOffload() if offload else None  # one for the blocks: a tensor they all take is copied once
    for block in blocks:
        if not isinstance(block, _CheckpointedForward):
            block.__class__ = _checkpointed_class(type(block), offload, context_fn)
            if host is not None:
                block._host_offload = host
