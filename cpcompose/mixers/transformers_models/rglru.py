"""RecurrentGemma's recurrent block under CP: its causal conv and its RG-LRU scan, exact over the global sequence.

`RecurrentGemmaRecurrentBlock` mixes tokens by its own code, at two calls: `self.conv_1d(x)
[..., :seq_len]` (a depthwise `nn.Conv1d` padded width-1 on both sides and truncated, so
causal) and `RecurrentGemmaRglru._rnn_scan`, the RG-LRU's diagonal recurrence
`h_t = a_t * h_{t-1} + x_t` (its gates and `sqrt(1 - a_t^2)` input scaling are per token and
computed before the scan). Everything else in the block runs as transformers wrote it.

The RG-LRU restarts where `position_ids == 0` (`reset`), in the scan and in the input
scaling alike (a reset token is not scaled), so under CP `position_ids` must be this rank's
positions under the region's layout (global, or restarting per document of a pack): the
scan checks its reset against the layout's document starts and refuses otherwise, on
every rank; a false reset mid-document would otherwise be honoured silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from cpcompose.comm import CPGroup
from cpcompose.mixers.api_checks import needs_grad, tensor_fields, whole_pack_refusal
from cpcompose.layouts import PackedLayout
from cpcompose.mixers.chunked import Correction, cp_chunked_recurrence
from cpcompose.mixers.conv import cp_causal_conv1d
from cpcompose.mixers.region import Region

__all__ = ["cp_recurrent_block", "cp_rglru_scan"]

_NO_CACHE = (
    "RecurrentGemmaRecurrentBlock got use_cache=True, which keeps this rank's conv and RG-LRU states as a "
    "generation cache: under CP call the model with use_cache=False"
)


def _causal_conv_refusal(conv: nn.Module) -> str | None:
    """Why `conv` is not the depthwise, causal (padded width-1, truncated) conv `cp_causal_conv1d` computes."""
    if not isinstance(conv, nn.Conv1d):
        return f"RecurrentGemmaRecurrentBlock.conv_1d is a {type(conv).__name__}, not an nn.Conv1d"
    width = conv.kernel_size[0]
    if (conv.groups, conv.out_channels, conv.stride, conv.dilation, conv.padding, conv.padding_mode) != (
            conv.in_channels, conv.in_channels, (1,), (1,), (width - 1,), "zeros"):
        return (f"RecurrentGemmaRecurrentBlock.conv_1d ({conv}) is not a depthwise conv padded width-1 with "
                "stride and dilation 1: it has no CP version")
    return None


def cp_recurrent_block(
    original: Callable[..., Any], region: Region, self: nn.Module, input_states: Tensor,
    position_ids: Tensor, attention_mask: Tensor | None, use_cache: bool | None = True, **kwargs: Any,
) -> tuple[Tensor, None]:
    """`RecurrentGemmaRecurrentBlock.forward` under CP: transformers' own forward, its `conv_1d` call answered
    by `cpcompose.mixers.cp_causal_conv1d` (each run gets its width-1 predecessors in its document).

    The answer is a forward hook on this block's conv for the duration of the call, so the
    rest of the forward (projections, gates, the RG-LRU, whose scan is routed too) stays
    transformers' code; the local conv it replaces is discarded (a depthwise conv: cheap).
    """
    conv = self.conv_1d
    error = _NO_CACHE if use_cache else _causal_conv_refusal(conv)

    def answer(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = args[0]  # (batch, channels, seq_local), as the block passes it
        out = cp_causal_conv1d(x.transpose(1, 2), module.weight, module.bias, mesh=region.mesh,
                               layout=region.options.layout, meter=region.options.meter, caller_error=error)
        return out.transpose(1, 2)  # seq_local outputs: the block's `[..., :seq_len]` keeps them all

    handle = conv.register_forward_hook(answer, prepend=True)
    try:
        return original(self, input_states, position_ids, attention_mask, use_cache=use_cache, **kwargs)
    finally:
        handle.remove()


def _reset_refusal(reset: Tensor, region: Region) -> str | None:
    """Why the scan's `reset` (`position_ids == 0`) is not the layout's document starts on this rank, or None.

    A PackedLayout's padding document is not checked: nothing reads its outputs.
    """
    layout, local_len = region.layout(), reset.shape[1] if reset.ndim == 3 else -1
    if layout is None or local_len < 0 or layout.local_len_error(local_len):
        return None  # the agreement reports the split
    rank = CPGroup.from_mesh(region.mesh).rank
    starts = layout.position_ids(rank, local_len * layout.world, reset.device) == 0
    checked = torch.ones_like(starts)
    if isinstance(layout, PackedLayout) and layout.pad:
        checked = layout.local_indices(rank, device=reset.device) < layout.seq_len - layout.pad
    if bool(((reset.reshape(-1, local_len) == starts) | ~checked).all()):
        return None
    return (
        f"RecurrentGemmaRglru resets its state where position_ids == 0, but this rank's position_ids are not "
        f"its positions under the {layout.name} split (resets at local rows "
        f"{reset.reshape(-1, local_len)[0].nonzero().flatten()[:8].tolist()}, document starts at "
        f"{starts.nonzero().flatten()[:8].tolist()}): pass the full position_ids (torch.arange(seq_len); for "
        "packed documents, restarting at 0 per document with pack_batch's PackedLayout) as a context_parallel buffer"
    )


def cp_rglru_scan(
    original: Callable[..., Any], region: Region, self: nn.Module, hidden_states: Tensor,
    recurrent_gate: Tensor, reset: Tensor, recurrent_states: Tensor | None,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, None]:
    """`RecurrentGemmaRglru._rnn_scan` under CP: the state `(batch, lru_width)` passed between runs.

    Each local stretch is scanned once, from zero, by transformers' own `_rnn_scan`
    (accumulating in `acc_dtype`, float32 as the RG-LRU calls it); a stretch's transition is
    the product of its gates `a_t * ~reset_t`, as the scan applies them, and one that
    continues a document gets `(a_1 ... a_t) h0` added to each output (a `Correction`:
    the outputs are the states, affine in h0), no second scan
    (`cpcompose.mixers.cp_chunked_recurrence`).

    Returns:
        `(outputs (batch, seq_local, lru_width), None)`: no final state (the RG-LRU keeps it
        as a generation cache, which CP refuses).
    """
    error = (whole_pack_refusal("RecurrentGemmaRglru._rnn_scan", {}, state=recurrent_states)
             or _reset_refusal(reset, region))

    finals: dict[int, Tensor] = {}
    wide = torch.promote_types(acc_dtype, hidden_states.dtype)  # the correction: the scan's precision or wider

    def kernel(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        out, final = original(self, hidden_states[:, rows], recurrent_gate[:, rows], reset[:, rows], init, acc_dtype)
        finals[rows.start] = final
        return out, final

    def decays(rows: slice) -> Tensor:
        return (recurrent_gate[:, rows] * ~reset[:, rows]).to(acc_dtype)  # as the scan applies them

    def transition(rows: slice) -> Tensor:
        return decays(rows).prod(dim=1)  # (batch, lru_width)

    def correct(rows: slice, out: Tensor, init: Tensor) -> Tensor:
        # h_t from init: h_t^0 + (a_1 ... a_t) init, each a_s zero at a reset (a reset inside the stretch stops it).
        carried = torch.cumprod(decays(rows).to(wide), dim=1) * init.to(wide)[:, None]
        return (out.to(wide) + carried).to(out.dtype)

    out = cp_chunked_recurrence(
        kernel, transition, mesh=region.mesh, layout=region.options.layout, seq_local=hidden_states.shape[1],
        kind="diagonal", out_dim=1, what="RecurrentGemmaRglru._rnn_scan", device=hidden_states.device,
        dtype=hidden_states.dtype, grad=needs_grad(hidden_states, recurrent_gate),
        signature=[*tensor_fields("hidden_states", hidden_states), *tensor_fields("reset", reset)],
        caller_error=error, meter=region.options.meter,
        correction=Correction(final=lambda rows: finals[rows.start], apply=correct),
    )
    return out, None
