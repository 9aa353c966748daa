"""RMSNorm that keeps only its input and one float32 scale per token for backward.

Written with autograd's ops, ``x.float() * rsqrt(mean(x.float() ** 2) + eps)`` saves the float32
copy of its input (4 bytes per element: twice a bf16 input) and its bf16 normalized value, and its
backward makes five float32 temporaries of the input's size at once. At long sequences these were
the largest tensors of a recomputed block: the memory rehearsal of a Llama-3-8B block at 131k
tokens per rank held 4 input-sizes of norm inputs in float32 and 10 more in the norms' backward at
its peak (scripts/longest_sequence.py). Here the forward saves the input it was given (which the
block keeps anyway) and the per-token scale; forward and backward work in row tiles, so the float32
temporaries are one tile's. The arithmetic is the autograd form's, operation for operation, per row;
the weight's gradient is summed over tiles in float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["ROW_TILE", "rms_norm"]

ROW_TILE = 8192
"""Rows (tokens) per tile of the float32 work: 128 MiB of float32 at width 4096, one tile per call at short
lengths."""


def _tiles(rows: int) -> list[tuple[int, int]]:
    return [(start, min(start + ROW_TILE, rows)) for start in range(0, rows, ROW_TILE)]


class _RMSNorm(torch.autograd.Function):
    """``(x.float() * rstd).type_as(x) * weight`` with ``rstd = rsqrt(mean(x.float() ** 2) + eps)`` per row."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        width = x.shape[-1]
        rows = x.reshape(-1, width)
        # made in x's shape and filled through a view: returned as a base tensor (FSDP2 warns of outputs that are
        # views, on which in-place ops would skip its hooks)
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        out_rows = out.view(-1, width)
        rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        for start, stop in _tiles(rows.shape[0]):
            x_float = rows[start:stop].float()
            rstd[start:stop] = torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
            out_rows[start:stop] = (x_float * rstd[start:stop]).type_as(x) * weight
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        width = x.shape[-1]
        rows, grads = x.reshape(-1, width), grad_out.reshape(-1, width)
        want_x, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if want_x else None  # contiguous
        grad_rows = None if grad_x is None else grad_x.view(-1, width)
        summed = torch.promote_types(torch.float32, weight.dtype)  # float32, or float64 for a float64 weight
        grad_weight = torch.zeros(width, dtype=summed, device=x.device) if want_weight else None
        for start, stop in _tiles(rows.shape[0]):
            normed = rows[start:stop].float() * rstd[start:stop]
            g = grads[start:stop]
            if grad_weight is not None:
                grad_weight += (g * normed.type_as(x)).to(summed).sum(0)
            if grad_x is not None:
                d_normed = (g * weight).float()
                mean = (d_normed * normed).mean(-1, keepdim=True)
                grad_rows[start:stop] = (rstd[start:stop] * (d_normed - normed * mean)).type_as(x)
        return (grad_x,
                None if grad_weight is None else grad_weight.to(weight.dtype), None)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x``'s last dimension scaled by ``weight``, computed in float32, returning the promoted dtype
    of ``x`` and ``weight``; lean in memory (see the module docstring).

    Under torch.compile, or with DTensor inputs (tensor parallelism), the same arithmetic runs as autograd ops:
    the compiler plans its own saved tensors, and a DTensor's sharding must flow through ops that know it.
    """
    if not isinstance(x, DTensor) and not isinstance(weight, DTensor) and not torch.compiler.is_compiling():
        return _RMSNorm.apply(x, weight, eps)
    x_float = x.float()
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight
