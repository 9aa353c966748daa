"""Activation checkpointing inside a CP region: recompute where the forward ran.

A CP region is a TorchFunctionMode, and a mode is off the stack while its own handler
runs, including the one for `loss.backward()` inside the region. So a checkpointed
forward recomputed during the backward would run outside the region: its attention
would be single-process attention on a shard. `recompute_context` is the
`context_fn` of non-reentrant `torch.utils.checkpoint` that captures the region at
forward time and re-enters it around the recomputation.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

from cpcompose.parallel.dispatch import active_cp_region

__all__ = ["recompute_context"]


def recompute_context() -> tuple[ContextManager[object], ContextManager[object]]:
    """`context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`.

    Use it as `checkpoint(fn, *args, use_reentrant=False, context_fn=recompute_context)`, or for
    a transformers model `model.activation_checkpointing_enable(
    activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": recompute_context})`.

    Returns:
        (forward context, recompute context): nothing around the forward; the CP region
        the forward ran in (if any) around the recomputation.
    """
    region = active_cp_region()
    return contextlib.nullcontext(), (region if region is not None else contextlib.nullcontext())
