"""The buffers no checkpoint holds, recomputed after loading as transformers would.

Non-persistent buffers (RoPE's `inv_freq`, Gemma's `embed_scale`) are in no checkpoint, and `to_empty`
leaves them uninitialised. transformers recomputes them after loading with the model's own
`_init_weights`; doing the same here lets each family's own code set them, and a check afterwards makes
a buffer it leaves unset an error rather than garbage.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers import initialization as hf_init

__all__ = ["init_non_persistent_buffers"]


def init_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Recompute the buffers no checkpoint holds (RoPE's `inv_freq`, ...), after `to_empty`, in place.

    Each module owning such a buffer is passed to its model's own `_init_weights` (what transformers runs
    after loading), with its parameters marked as initialised so that only the buffers are written. Every
    floating-point buffer is filled with NaN first and checked afterwards, so a buffer `_init_weights` does
    not set is an error, not garbage.

    Returns:
        The names of the buffers recomputed.
    Raises:
        ValueError: a buffer `_init_weights` left unset (named, with its module's class).
    """
    owners: dict[nn.Module, PreTrainedModel] = {}
    for outer in model.modules():
        if isinstance(outer, PreTrainedModel):
            owners.update({m: outer for m in outer.modules()})  # the innermost model wins (visited later)
    names: list[str] = []
    unset: list[tuple[str, Tensor, nn.Module]] = []
    for prefix, module in model.named_modules():
        buffers = [(n, b) for n, b in module.named_buffers(recurse=False)
                   if n in module._non_persistent_buffers_set and b is not None]
        if not buffers or module not in owners:
            continue
        for _, buffer in buffers:
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
        _init_buffers_of(owners[module], module, recurse=False)
        for name, buffer in buffers:
            full = f"{prefix}.{name}" if prefix else name
            if buffer.is_floating_point() and bool(torch.isnan(buffer).any()):
                unset.append((full, buffer, module))
            else:
                names.append(full)
    for full, buffer, module in unset:
        # Some models set a layer's buffer from an ancestor's branch of `_init_weights` (Falcon-H1's `mup_vector`,
        # set when it is called on the FalconH1Model): try the ancestors, nearest first.
        parts = full.split(".")[:-1]
        for depth in range(len(parts) - 1, -1, -1):
            ancestor = model.get_submodule(".".join(parts[:depth]))
            if ancestor in owners:
                _init_buffers_of(owners[ancestor], ancestor, recurse=True)
            if not bool(torch.isnan(buffer).any()):
                break
        if bool(torch.isnan(buffer).any()):
            raise ValueError(f"the buffer {full} of {type(module).__name__} is in no checkpoint and its model's "
                             "_init_weights does not set it, so it cannot be recomputed after loading")
        names.append(full)
    return names


def _init_buffers_of(owner: PreTrainedModel, module: nn.Module, *, recurse: bool) -> None:
    """`owner._init_weights(module)` with `module`'s parameters marked as initialised, so only buffers are written."""
    params = list(module.parameters(recurse=recurse))
    for p in params:
        p._is_hf_initialized = True  # transformers' init functions skip these: only the buffers are written
    try:
        with torch.no_grad(), hf_init.guard_torch_init_functions():
            owner._init_weights(module)
    finally:
        for p in params:
            del p._is_hf_initialized
