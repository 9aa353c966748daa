"""Token mixers outside attention under CP: transformers' kernel functions, routed inside a CP region.

transformers 5.x computes each token mixer of its hybrid models (Mamba, Mamba2, Gated
DeltaNet, short convolutions, ...) through a few module-level *kernel functions* of the
model's modeling file, each with one fixed API that mamba-ssm, causal-conv1d or
flash-linear-attention also implement: `causal_conv1d_fn`, `mamba2_chunk_scan`
(mamba_ssm's `mamba_chunk_scan_combined`), `torch_chunk_gated_delta_rule` (fla's
`chunk_gated_delta_rule`), ... Only these functions see more than one token of the
sequence; the model's own code around them (projections, norms, gates) is per token.

So the integration wraps each of them, in every modeling module that has one: outside a
CP region the wrapper calls the original (transformers is unchanged); inside one it calls
cpcompose's CP version (`ROUTES`), which is exact over the global sequence under the
region's layout (documents of a pack restart), running the original on this rank's runs
where it can, so a fast kernel that is installed stays in use. A fused path that would
see only the local shard (`mamba2_split_conv1d_scan_combined`, `mamba_inner_fn`) returns
None inside a region, which transformers reads as "not available".

Module classes that mix tokens by their own code and have no CP version are refused by
class inside a region (`REFUSED`), on every rank alike; anything else that mixes tokens
outside attention is what `cpcompose.parallel.verify` finds.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType, ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpcompose.mixers.chunked import cp_chunked_recurrence
from cpcompose.mixers.conv import cp_causal_conv1d
from cpcompose.parallel.dispatch import CPAttentionMode, active_cp_region

__all__ = ["MODELING_MODULES", "REFUSED", "ROUTES", "install", "refused_in", "routed_functions"]

KernelCP = Callable[..., Any]
"""`cp(original, region, *args, **kwargs)`: a kernel function's CP version (same arguments as the original)."""

_ACTIVATIONS = {None: None, "silu": "silu", "swish": "silu"}


def cp_causal_conv1d_fn(
    original: Callable[..., Tensor], region: CPAttentionMode, hidden_states: Tensor, weight: Tensor,
    bias: Tensor | None = None, activation: str | None = None, **kwargs: Any,
) -> Tensor:
    """`causal_conv1d_fn(x (batch, channels, seq), weight (channels, width), bias, activation)` under CP.

    Each of this rank's runs receives the width-1 tokens before it in its document from
    their owners (`cpcompose.mixers.cp_causal_conv1d`); transformers' own computes in
    the weight's dtype and returns the input's, and so does this.
    """
    error = None
    if any(kwargs.get(name) is not None for name in ("seq_idx", "cu_seqlens", "initial_states")):
        error = (
            "causal_conv1d_fn got seq_idx/cu_seqlens/initial_states, which describe the whole pack: under CP "
            "the documents come from the layout (pack_batch), so call the model without them"
        )
    elif activation not in _ACTIVATIONS:
        error = f"causal_conv1d_fn activation={activation!r} has no CP version; one of {tuple(_ACTIVATIONS)[1:]}"
    out = cp_causal_conv1d(
        hidden_states.transpose(1, 2).to(weight.dtype), weight, bias, mesh=region.mesh, layout=region.options.layout,
        activation=_ACTIVATIONS.get(activation), meter=region.options.meter, caller_error=error,
    )
    return out.transpose(1, 2).to(hidden_states.dtype)


def _grad(*tensors: object) -> bool:
    """Whether a backward will run through these inputs (it communicates, so every rank must agree)."""
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _whole_pack_refusal(function: str, kwargs: Mapping[str, Any], *, state: object = None, final: bool = False
                        ) -> str | None:
    """Why a kernel call carries what only a single-process call can honour (a cache's states, the whole pack's
    document boundaries), or None."""
    if state is not None or final:
        return (f"{function} got an initial state or was asked for its final state (a generation cache): under CP "
                "call the model with use_cache=False and no cache")
    if any(kwargs.get(name) is not None for name in ("seq_idx", "cu_seqlens")):
        return (f"{function} got seq_idx/cu_seqlens, which describe the whole pack: under CP the documents come "
                "from the layout (pack_batch), so call the model without them")
    return None


def cp_mamba2_chunk_scan(
    original: Callable[..., Any], region: CPAttentionMode, hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor,
    C: Tensor, chunk_size: int, D: Tensor | None = None, dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf), return_final_states: bool = False, **kwargs: Any,
) -> Tensor:
    """Mamba2's SSD scan (`mamba_chunk_scan_combined`'s API) under CP: the state passed between runs.

    The state `(batch, heads, head_dim, state)` decays by one scalar per head and token,
    `exp(dt * A)` after `dt`'s bias, softplus and clamp, as the kernel applies them; a run's
    transition is the product over its tokens (`cpcompose.mixers.cp_chunked_recurrence`).
    """
    error = _whole_pack_refusal("mamba2_chunk_scan", kwargs, state=initial_states, final=return_final_states)

    def kernel(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        return original(hidden_states[:, rows], dt[:, rows], A, B[:, rows], C[:, rows], chunk_size, D=D,
                        dt_bias=dt_bias, initial_states=init, dt_softplus=dt_softplus, dt_limit=dt_limit,
                        return_final_states=True)

    def transition(rows: slice) -> Tensor:
        step = dt[:, rows] if dt_bias is None else dt[:, rows] + dt_bias.to(dt.dtype)
        step = torch.clamp(F.softplus(step) if dt_softplus else step, min=dt_limit[0], max=dt_limit[1])
        return torch.exp((step.float() * A.float()).sum(dim=1))[..., None, None]  # (batch, heads, 1, 1)

    return cp_chunked_recurrence(
        kernel, transition, mesh=region.mesh, layout=region.options.layout, seq_local=hidden_states.shape[1],
        kind="diagonal", out_dim=1, what="mamba2_chunk_scan", device=hidden_states.device,
        dtype=hidden_states.dtype, grad=_grad(hidden_states, dt, A, B, C, D, dt_bias),
        signature=[*_shape("hidden_states", hidden_states), *_shape("B", B), ("chunk_size", int(chunk_size))],
        caller_error=error, meter=region.options.meter,
    )


def _shape(name: str, t: Tensor) -> list[tuple[str, int]]:
    return [(name, int(d)) for d in t.shape] + [(name, t.ndim)]


def _local_only(original: Callable[..., Any], region: CPAttentionMode, *args: Any, **kwargs: Any) -> None:
    """A fused kernel that would see this rank's shard only: "not available" inside a CP region."""
    return None


ROUTES: Mapping[str, KernelCP] = MappingProxyType({
    "causal_conv1d_fn": cp_causal_conv1d_fn,
    "mamba2_chunk_scan": cp_mamba2_chunk_scan,
    "mamba2_split_conv1d_scan_combined": _local_only,
    "mamba_inner_fn": _local_only,
})
"""Kernel function name -> its CP version. A name in a modeling module that is not here stays local
only if the module's mixers never reach it inside a region (the tests of each family show they do not)."""

MODELING_MODULES: tuple[str, ...] = (
    "lfm2", "lfm2_moe", "lfm3",
    "mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2",
)
"""The modeling modules (`transformers.models.<name>.modeling_<name>`) whose kernel functions are routed."""

REFUSED: Mapping[str, str] = MappingProxyType({})
"""`module.ClassName` -> why CP cannot make it exact yet: refused inside a region, on every rank."""


def _routed(name: str, original: Callable[..., Any], cp: KernelCP) -> Callable[..., Any]:
    """`original` outside a CP region, `cp(original, region, ...)` inside one."""

    @functools.wraps(original)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        region = active_cp_region()
        if region is None:
            return original(*args, **kwargs)
        region.routed += 1  # a token mixer that went through CP (a pure Mamba model has no attention)
        return cp(original, region, *args, **kwargs)

    kernel.__cpcompose_route__ = name  # type: ignore[attr-defined]
    return kernel


def _modeling(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:  # an older or newer transformers without this family
        return None


def _refusing(cls: type[nn.Module], reason: str) -> None:
    forward = cls.forward

    @functools.wraps(forward)
    def refuse(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if active_cp_region() is not None:
            raise ValueError(f"{cls.__name__} mixes tokens outside attention and {reason}")
        return forward(self, *args, **kwargs)

    cls.forward = refuse  # type: ignore[method-assign]


def install() -> None:
    """Route the kernel functions of every module in `MODELING_MODULES` and refuse `REFUSED` (once)."""
    for name in MODELING_MODULES:
        module = _modeling(name)
        if module is None:
            continue
        for function, cp in ROUTES.items():
            original = getattr(module, function, None)
            if callable(original) and not hasattr(original, "__cpcompose_route__"):
                setattr(module, function, _routed(function, original, cp))
    for path, reason in REFUSED.items():
        module_name, cls_name = path.rsplit(".", 1)
        module = importlib.import_module(module_name)
        cls = getattr(module, cls_name, None)
        if isinstance(cls, type) and not getattr(cls.forward, "__cpcompose_refused__", False):
            _refusing(cls, reason)
            cls.forward.__cpcompose_refused__ = True  # type: ignore[attr-defined]


def routed_functions() -> dict[str, list[str]]:
    """Per routed modeling module, the kernel functions now routed (for tests and the README table)."""
    found: dict[str, list[str]] = {}
    for name in MODELING_MODULES:
        module = _modeling(name)
        if module is not None:
            found[name] = sorted(f for f in ROUTES if hasattr(getattr(module, f, None), "__cpcompose_route__"))
    return found


def refused_in(model: nn.Module) -> list[str]:
    """The modules of `model` whose class `REFUSED` names, as `name (Class): reason` (checked before a run)."""
    refused = {path.rsplit(".", 1)[1]: reason for path, reason in REFUSED.items()}
    return [f"{name} ({type(m).__name__}): {refused[type(m).__name__]}" for name, m in model.named_modules()
            if type(m).__name__ in refused]
