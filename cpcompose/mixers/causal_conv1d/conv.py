"""`causal_conv1d_fn` under CP: every run gets its width-1 predecessors in its document from their owners."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from cpcompose.mixers.conv import cp_causal_conv1d
from cpcompose.mixers.region import Region

__all__ = ["cp_causal_conv1d_fn"]

_ACTIVATIONS = {None: None, "silu": "silu", "swish": "silu"}


def cp_causal_conv1d_fn(
    original: Callable[..., Tensor], region: Region, hidden_states: Tensor, weight: Tensor,
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
