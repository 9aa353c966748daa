"""The exactness probe for Hugging Face models: by class first, then measured, once per model.

`verify(model, mesh)` refuses the module classes cpcompose knows it cannot make exact
(`mixer_routes.REFUSED`, no communication), then runs `cpcompose.verify` on a short random
sequence: transformers on one process against the same model under CP, module by module.
Importing the integration also runs it automatically on a model's first forward inside
a CP region (`CPOptions.verify`, default on; `context_parallel(..., verify=False)` skips
it): the probe's single-process run steps out of the region for its duration.

Whether or not the probe runs, that first forward checks one thing every rank agrees on before
any layer runs: a model with attention layers must compute them through "cpcompose" (or "sdpa",
which the region routes or refuses). Any other implementation (eager, flash_attention_2, flex,
a hub kernel) computes attention in transformers' own code on the rank's shard alone; in a hybrid
model the mixers' CP calls would hide that from the region's end-of-forward check.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from cpcompose import _compat
from cpcompose.agreement import agree_across_ranks
from cpcompose.attention.call.options import CPOptions
from cpcompose.comm import CPGroup
from cpcompose.integrations.transformers.implementation import ATTN_IMPLEMENTATION
from cpcompose.integrations.transformers.mixer_routes import refused_in
from cpcompose.parallel.dispatch import active_cp_region
from cpcompose.parallel.verify import verify as verify_modules

__all__ = ["CP_ATTENTION_IMPLEMENTATIONS", "PROBE_TOKENS_PER_RANK", "implementation_refusal",
           "install_first_use_probe", "verify"]

PROBE_TOKENS_PER_RANK = 16
"""Tokens per CP rank of the probe's sequence: short, but longer than a conv's width and a chunk."""

CP_ATTENTION_IMPLEMENTATIONS = (ATTN_IMPLEMENTATION, "sdpa")
"""The attention implementations a CP region can see: "cpcompose", and "sdpa", whose calls it routes (or refuses)."""

_ATTENTION_FLAGS = ("_supports_attention_backend", "_supports_sdpa", "_supports_flash_attn", "_supports_flex_attn")
"""transformers' class flags of a model with attention layers (a Mamba, RWKV or xLSTM model has none of them)."""

_VERIFIED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models probed in this process (owned by the models)
_CHECKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose attention implementation the ranks agreed on


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
    extra: dict[str, Any] = {"use_cache": False}
    if _adds_router_loss(model):
        # transformers' load-balancing loss (`aux_loss`) is a statistic of every token of the forward: under CP each
        # rank's is its shard's, rightly different (`cp_load_balancing_loss` is the exact one, from the router
        # logits, which are per token and compared module by module like any other output)
        extra["output_router_logits"] = False
    training = model.training
    model.eval()  # dropout would make the two runs differ
    try:
        verify_modules(model, mesh, {"input_ids": ids, "position_ids": positions}, options=opts,
                       forward=lambda **inputs: model(**inputs, **extra))
    finally:
        model.train(training)
        _reshard(model)
    _VERIFIED.update(m for m in model.modules() if _is_hf_model(m))


def _adds_router_loss(model: nn.Module) -> bool:
    """Whether the model's forward returns transformers' router loss (`output_router_logits` in its config)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "output_router_logits", False) or getattr(text, "output_router_logits", False))


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


def implementation_refusal(model: nn.Module) -> str | None:
    """Why `model`'s attention layers would run on a rank's shard alone inside a CP region, or None.

    The text model's implementation decides (a vision tower attends over image patches, which CP does not split).
    """
    if not any(getattr(type(model), flag, False) for flag in _ATTENTION_FLAGS):
        return None
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = getattr(text, "_attn_implementation", None)
    if not isinstance(implementation, str) or implementation in CP_ATTENTION_IMPLEMENTATIONS:
        return None
    return (f"{type(model).__name__} was built with attn_implementation={implementation!r}, whose attention runs in "
            f"transformers' own code on this rank's shard alone under CP; build it with attn_implementation="
            f"\"{ATTN_IMPLEMENTATION}\"")


def _first_use(module: nn.Module, args: Any) -> None:
    """On a Hugging Face model's first forward inside a CP region (once per model object): every rank agrees that
    its attention is CP-aware, then the probe runs (unless the region's `verify` is off)."""
    # Compiling first: traced, this hook must not read the sets below (dynamo would guard on their weak entries,
    # which come and go with other models, and recompile); then the cheap per-module test.
    if torch.compiler.is_compiling() or not _is_hf_model(module) or (module in _CHECKED and module in _VERIFIED):
        return
    region = active_cp_region()
    if region is None or _compat.in_backward():
        return
    if module not in _CHECKED:
        _CHECKED.update(m for m in module.modules() if _is_hf_model(m))
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        agree_across_ranks(CPGroup.from_mesh(region.mesh), implementation_refusal(module), [],
                           what="Hugging Face model under CP",
                           device=device if device.type == "cuda" else torch.device("cpu"))
    if region.options.verify and module not in _VERIFIED:
        _VERIFIED.update(m for m in module.modules() if _is_hf_model(m))  # before: the probe calls the model itself
        with _compat.function_modes_suspended():
            verify(module, region.mesh, options=region.options)


_HOOK: list[Any] = []  # the one global pre-hook's handle (installed once per process)


def install_first_use_probe() -> None:
    """Register the first-use probe as a global module forward pre-hook (idempotent)."""
    if not _HOOK:
        _HOOK.append(torch.nn.modules.module.register_module_forward_pre_hook(_first_use))
