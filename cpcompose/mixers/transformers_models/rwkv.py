"""RWKV (v4) under CP: its token shift and its WKV recurrence, exact over the global sequence.

RWKV mixes tokens at two places. Both blocks (`RwkvSelfAttention`, `RwkvFeedForward`)
mix each token with the one before it through `self.time_shift` (an `nn.ZeroPad2d` that
shifts the sequence by one: zero before the first token); under CP each run's first
token reads the last token before it in its document, from its owner. And the WKV
recurrence (`rwkv_linear_attention`, the module-level kernel function, with the CUDA
kernel or the CPU loop behind it) carries per channel

    num_t = exp(w) num_{t-1} + exp(k_t) v_t,   den_t = exp(w) den_{t-1} + exp(k_t),
    o_t = (num_{t-1} + exp(u + k_t) v_t) / (den_{t-1} + exp(u + k_t)),   w = -exp(time_decay),

a state that is linear in its initial value with a constant diagonal decay, so a run's
transition is `exp(w * length)` (`cpcompose.mixers.cp_chunked_recurrence`, kind "diagonal").

The kernel keeps the state as `(num, den, max)` scaled by `exp(-max)` for range. Between
runs it travels unscaled, `(num, den) * exp(max)`, in float64 (exp of a key up to ~700
fits; the kernel's own keys are float32), and enters a rerun rescaled by its own `den`
(`max = log den`, so `den = 1`): the outputs are invariant to that scale, so the rerun is
the sequential run up to rounding, and float32 ranges hold whatever the document's length.

transformers' CUDA WKV kernel (loaded from the hub when available) returns no gradient for
its initial state and none through its final state: state passed between ranks would cut
the gradient silently. So when a backward will run, the runs go through the modeling file's
torch loop (`rwkv_linear_attention_cpu`, any device) instead: exact, and as slow as
transformers without the kernel.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from cpcompose.mixers.api_checks import needs_grad, tensor_fields, whole_pack_refusal
from cpcompose.mixers.chunked import cp_chunked_recurrence
from cpcompose.mixers.conv import cp_causal_conv1d
from cpcompose.mixers.region import Region

__all__ = ["cp_rwkv_block", "cp_rwkv_linear_attention"]


def _differentiable(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original`, or its modeling file's torch loop where the CUDA kernel (no state gradients) is loaded."""
    modeling = sys.modules.get(getattr(original, "__module__", ""))
    loop = getattr(modeling, "rwkv_linear_attention_cpu", None)
    return loop if loop is not None and getattr(modeling, "rwkv_cuda_kernel", None) is not None else original


def cp_rwkv_linear_attention(
    original: Callable[..., Any], region: Region, time_decay: Tensor, time_first: Tensor, key: Tensor,
    value: Tensor, state: Any = None, return_state: bool = False,
) -> tuple[Tensor, None]:
    """`rwkv_linear_attention(time_decay, time_first, key, value, state, return_state)` under CP.

    key, value `(batch, seq_local, channels)`; time_decay, time_first `(channels,)`. Each
    local run goes through the original kernel (the CUDA kernel when loaded and no backward
    will run, else the torch loop), from its true state where it continues a document.

    Returns:
        `(output (batch, seq_local, channels), None)`: no state (RWKV keeps it for generation,
        which CP refuses).
    """
    error = whole_pack_refusal("rwkv_linear_attention", {}, state=state, final=bool(return_state))
    if error is None and (key.ndim != 3 or value.shape != key.shape or time_decay.shape != key.shape[-1:]):
        error = (f"rwkv_linear_attention: key and value must be (batch, seq, channels) of one shape and time_decay "
                 f"(channels,), got {tuple(key.shape)}, {tuple(value.shape)} and {tuple(time_decay.shape)}")
    grad = needs_grad(time_decay, time_first, key, value)
    wkv = _differentiable(original) if grad else original
    state_dtype = torch.float32 if key.is_cuda else torch.float64  # the CUDA kernel keeps float32 states

    def kernel(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        start = None
        if init is not None:  # unscaled (num, den) -> the kernel's form, scaled by den
            den = init[..., 1].clamp_min(torch.finfo(init.dtype).tiny)
            start = [(init[..., 0] / den).to(state_dtype), torch.ones_like(den, dtype=state_dtype),
                     den.log().to(state_dtype)]
        out, (num, den_end, top) = wkv(time_decay, time_first, key[:, rows], value[:, rows], state=start,
                                       return_state=True)
        scale = top.double().exp()
        return out, torch.stack([num.double() * scale, den_end.double() * scale], dim=-1)

    def transition(rows: slice) -> Tensor:
        decay = -torch.exp(time_decay.double()) * (rows.stop - rows.start)
        return decay.exp()[None, :, None]  # (1, channels, 1): both halves of the state decay alike

    out = cp_chunked_recurrence(
        kernel, transition, mesh=region.mesh, layout=region.options.layout, seq_local=key.shape[1],
        kind="diagonal", out_dim=1, what="rwkv_linear_attention", device=key.device, dtype=key.dtype,
        grad=grad, signature=[*tensor_fields("key", key), *tensor_fields("value", value)], caller_error=error,
        meter=region.options.meter,
    )
    return out, None


def cp_rwkv_block(
    original: Callable[..., Any], region: Region, self: nn.Module, hidden: Tensor, state: Any = None,
    *args: Any, **kwargs: Any,
) -> Any:
    """`RwkvSelfAttention.forward` / `RwkvFeedForward.forward` under CP: transformers' own forward, its
    `time_shift` answered with the token before each run in its document (zero at a document start).

    The shift is a causal depthwise conv of width 2 with weights `[1, 0]` (`cp_causal_conv1d`:
    the agreement, the halo from the owner, the document starts), exact: a product by 1 and
    a sum with 0. The answer is a forward hook on this block's `time_shift` for the call.
    """
    error = None
    if state is not None:
        error = (f"{type(self).__name__} got a state (use_cache=True or a state= argument): RWKV's state is a "
                 "generation cache; under CP call the model with use_cache=False and no state")

    def answer(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = inputs[0]  # (batch, seq_local, channels)
        weight = x.new_zeros(x.shape[-1], 2)
        weight[:, 0] = 1  # out[t] = x[t-1]
        return cp_causal_conv1d(x, weight, mesh=region.mesh, layout=region.options.layout,
                                meter=region.options.meter, caller_error=error)

    handle = self.time_shift.register_forward_hook(answer, prepend=True)
    try:
        return original(self, hidden, state, *args, **kwargs)
    finally:
        handle.remove()
