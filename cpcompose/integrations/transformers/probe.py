"""The exactness probe for Hugging Face models: by class first, then measured, once per model.

`verify(model, mesh)` refuses the module classes cpcompose knows it cannot make exact
(`kernels.REFUSED`, no communication), then runs `cpcompose.verify` on a short random
sequence: transformers on one process against the same model under CP, module by module.
Importing the integration also runs it automatically on a model's first forward inside
a CP region (`CPOptions.verify`, default on; `context_parallel(..., verify=False)` skips
it): the probe's single-process run steps out of the region for its duration.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from cpcompose import _compat
from cpcompose.attention.call.options import CPOptions
from cpcompose.comm import CPGroup
from cpcompose.integrations.transformers.kernels import refused_in
from cpcompose.parallel.dispatch import active_cp_region
from cpcompose.parallel.verify import verify as verify_modules

__all__ = ["PROBE_TOKENS_PER_RANK", "install_first_use_probe", "verify"]

PROBE_TOKENS_PER_RANK = 16
"""Tokens per CP rank of the probe's sequence: short, but longer than a conv's width and a chunk."""

_VERIFIED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models probed in this process (owned by the models)


def verify(model: nn.Module, mesh: DeviceMesh, *, options: CPOptions | None = None, **overrides: Any) -> None:
    """Check that a Hugging Face causal LM is exact under CP (see the module docstring).

    Args:
        model: the model (its config's `vocab_size` gives the probe's token range).
        mesh: the 1-D CP mesh.
        options, **overrides: the CP options to check with (strategy, ...); the layout is
            zigzag over the probe's own sequence.

    Raises:
        ValueError: on every rank, naming a refused module class, or the first module that differs.
    """
    refused = refused_in(model)
    if refused:  # the same model on every rank: every rank raises this, before any collective
        raise ValueError("cpcompose cannot make this model exact under CP: " + "; ".join(refused))
    world = CPGroup.from_mesh(mesh).world
    length = 2 * world * (PROBE_TOKENS_PER_RANK // 2)
    vocab = int(getattr(model.config, "vocab_size", 2))
    generator = torch.Generator().manual_seed(0)  # the same tokens on every rank
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = torch.randint(0, vocab, (1, length), generator=generator).to(device)
    positions = torch.arange(length, device=device)[None]
    opts = (options or CPOptions()).replace(layout=None, verify=False, meter=None, **overrides)
    training = model.training
    model.eval()  # dropout would make the two runs differ
    try:
        verify_modules(model, mesh, {"input_ids": ids, "position_ids": positions}, options=opts,
                       forward=lambda **inputs: model(**inputs, use_cache=False))
    finally:
        model.train(training)
        _reshard(model)
    _VERIFIED.update(m for m in model.modules() if _is_hf_model(m))


def _reshard(model: nn.Module) -> None:
    """Shard again what FSDP gathered for the probe's forwards, which have no backward to do it.

    FSDP's root unit stays gathered after a forward (for the backward that follows), and while
    gathered its module attributes are the gathered tensors: an optimizer built after the probe
    would hold those instead of the shards and its updates would be lost (measured in the
    trainer: embedding, final norm and output layer off after one step).
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _is_hf_model(module: nn.Module) -> bool:
    return hasattr(module, "config") and hasattr(module, "can_generate")


def _first_use(module: nn.Module, args: Any) -> None:
    """Probe a Hugging Face model on its first forward inside a CP region (once per model object)."""
    if module in _VERIFIED or not _is_hf_model(module):
        return
    region = active_cp_region()
    if region is None or not region.options.verify or torch.compiler.is_compiling() or _compat.in_backward():
        return
    _VERIFIED.update(m for m in module.modules() if _is_hf_model(m))  # before: the probe calls the model itself
    with _compat.function_modes_suspended():
        verify(module, region.mesh, options=region.options)


_HOOK: list[Any] = []  # the one global pre-hook's handle (installed once per process)


def install_first_use_probe() -> None:
    """Register the first-use probe as a global module forward pre-hook (idempotent)."""
    if not _HOOK:
        _HOOK.append(torch.nn.modules.module.register_module_forward_pre_hook(_first_use))
