"""What every CP version of a kernel API checks: whether a backward will run, what it refuses, its signature fields.

The versions live by API (`mamba_ssm/`, `fla/`, `transformers_models/`); what every mixer entry point shares
(validation and the cross-rank agreement) is in `_checks.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from cpcompose.agreement import Field, shape_fields

__all__ = ["needs_grad", "tensor_fields", "whole_pack_refusal"]


def needs_grad(*tensors: object) -> bool:
    """Whether a backward will run through these inputs (it communicates, so every rank must agree)."""
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def whole_pack_refusal(function: str, kwargs: Mapping[str, Any], *, state: object = None, final: bool = False
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


def tensor_fields(name: str, t: object) -> list[Field]:
    """A tensor's shape as signature fields: a fixed number of them (up to 8 dims, padded, then the count),
    whatever its rank, since the ranks' signatures cross in one all-gather of equal sizes."""
    return shape_fields(name, tuple(t.shape) if isinstance(t, Tensor) else (), 8)


