"""transformers' activation checkpointing, recomputed in the CP region its forward ran in, whatever its kwargs.

`model.gradient_checkpointing_enable()` (or `activation_checkpointing_enable()`) with transformers'
defaults checkpoints each decoder layer with non-reentrant `torch.utils.checkpoint` and no
`context_fn`. Its recomputation runs inside `loss.backward()`, where the CP region (a
TorchFunctionMode, off the stack while its own handler runs) is not active: attention refused it
by name, and a layer whose last token mixer is a routed kernel (Mamba2, Mamba, LFM2,
RecurrentGemma, xLSTM, MiniMax) recomputed single-process on its shard, saved another number of
tensors, and failed inside torch (`CheckpointError`); with `use_reentrant=True` it would have been
silently wrong.

So the checkpoint function transformers gives each layer is wrapped: a call made inside a region
captures it, and the recomputation re-enters it when it runs outside (what
`cpcompose.parallel.recompute_context` does for a `context_fn`). Every family's checkpointing is
then exact under CP with any checkpoint kwargs, reentrant included; outside a region nothing changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.utils.checkpoint import checkpoint as torch_checkpoint
from transformers import PreTrainedModel

from cpcompose.parallel.dispatch import active_cp_region

__all__ = ["install_checkpointing_in_region"]

_WRAPPED = "__cpcompose_in_region__"


def _in_region(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """`checkpoint(function, *args, **kwargs)` whose recomputation of `function` re-enters the forward's region."""
    if getattr(checkpoint, _WRAPPED, False):
        return checkpoint

    @functools.wraps(checkpoint)
    def checkpoint_in_region(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        region = active_cp_region()
        if region is None:  # not under CP: as transformers does it
            return checkpoint(function, *args, **kwargs)

        def run(*a: Any, **k: Any) -> Any:
            if active_cp_region() is not None:  # the forward, or a recompute already inside (context_fn)
                return function(*a, **k)
            with region:  # the recomputation, inside loss.backward(): the forward's region again
                return function(*a, **k)

        return checkpoint(run, *args, **kwargs)

    setattr(checkpoint_in_region, _WRAPPED, True)
    return checkpoint_in_region


def install_checkpointing_in_region() -> None:
    """Wrap the checkpoint function `PreTrainedModel._set_gradient_checkpointing` hands to each layer (once)."""
    original = PreTrainedModel._set_gradient_checkpointing
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def set_gradient_checkpointing(self: PreTrainedModel, enable: bool = True, gradient_checkpointing_func:
                                   Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        return original(self, enable, _in_region(gradient_checkpointing_func or torch_checkpoint), **kwargs)

    setattr(set_gradient_checkpointing, _WRAPPED, True)
    PreTrainedModel._set_gradient_checkpointing = set_gradient_checkpointing  # type: ignore[method-assign]
