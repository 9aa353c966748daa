"""The LM head and cross-entropy fused and chunked over tokens: the logits are never whole.

At a 128k vocabulary the logits of a long local sequence, their float32 copy, the log-softmax
and its gradient cost several times the rest of a step (issue 21). `linear_cross_entropy_sum`
computes `sum_i CE(head(hidden_i), label_i)` a chunk of tokens at a time, and (as Liger does) turns each
chunk's logits, while it has them, into that chunk's hidden gradient and its share of the weight (and bias)
gradient; backward only scales those by the upstream gradient, so no logits are recomputed. So one chunk of `chunk_tokens x vocab`
logits exists at a time, forward or backward, instead of `tokens x vocab` several times over: the
log-sum-exp and the softmax gradient are computed in place in it (two chunk-sized tensors with
softcapping, whose tanh backward keeps; under bf16 the chunk's bf16 matmul output or gradient beside it).
The memory plan counts exactly this (`MemoryProfile.fused_loss_chunk`, checked by a live-storage probe).

The arithmetic is the unfused one, chunk by chunk: logits in the inputs' dtype from the same
`F.linear`, then the log-sum-exp, softcapping and the softmax gradient in `accumulation_dtype`
(float32 for bf16/fp16, float64 for float64), so float64 results equal the unfused ones to a few ulps.
The weight and bias gradients accumulate over chunks in that dtype too and are rounded once.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cpcompose.precision import accumulation_dtype

__all__ = ["linear_cross_entropy_sum"]


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Inside the Function the dtypes are the caller's choice (autocast was applied to the inputs already);
    the trainer's backward runs under autocast too, which must not recast the recomputed chunks."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """One chunk's logits in the accumulation dtype, and tanh(z / softcap) when softcapping (for backward)."""
    z = F.linear(hidden, weight, bias).to(accumulation_dtype(hidden.dtype))
    if softcap is None:
        return z, None
    t = z.div_(softcap).tanh_()  # in place: z is this chunk's own, and one vocabulary-wide buffer fewer
    return t * softcap, t


def _logsumexp_(z: Tensor) -> tuple[Tensor, Tensor]:
    """`torch.logsumexp(z, dim=-1)` by ATen's own steps, but in z's memory: z becomes `exp(z - max)` (so
    `z / sums` is the softmax), and the row sums are returned beside the log-sum-exp.

    ATen's makes a temporary as large as z (`(z - max).exp_()`), which would double a chunk's peak.
    """
    m = z.amax(dim=-1, keepdim=True)
    m.masked_fill_(m.abs() == float("inf"), 0)  # as ATen: an infinite row's max is taken as 0
    sums = z.sub_(m).exp_().sum(dim=-1)
    return sums.log().add_(m.squeeze(-1)), sums


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies of `F.linear(hidden, weight, bias)` (optionally softcapped), by chunks.

    Liger's order: the forward, which has each chunk's logits in hand, also turns them into that chunk's
    gradients (for a unit upstream gradient) and keeps those; the backward only scales them by the upstream
    gradient, so no chunk's logits are made twice.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
        softcap: float | None, ignore_index: int, chunk_tokens: int,
    ) -> Tensor:
        acc = accumulation_dtype(hidden.dtype)
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if want_bias else None
        with _no_autocast(hidden.device.type):
            for start in range(0, hidden.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                logits, t = _logits(hidden[rows], weight, bias, softcap)
                valid = labels[rows] != ignore_index
                index = torch.where(valid, labels[rows], 0).unsqueeze(1)
                target = logits.gather(1, index).squeeze(1)
                lse, sums = _logsumexp_(logits)  # overwrites logits with exp(logits - max): the target was read
                total += torch.where(valid, lse - target, 0).sum()
                if any(ctx.needs_input_grad[:3]):
                    # d(lse - logit_target)/d logits = softmax - onehot(target); ignored tokens contribute nothing.
                    grad = logits.div_(sums.unsqueeze(1))
                    grad.scatter_add_(1, index, torch.full_like(lse, -1.0).unsqueeze(1))
                    grad.mul_(valid.to(acc).unsqueeze(1))
                    if t is not None:  # through softcap * tanh(z / softcap): times 1 - tanh^2
                        grad.mul_(t.mul_(t).neg_().add_(1))
                        t = None  # gone before the bf16 copy of grad is made
                    if grad_hidden is not None:
                        grad_hidden[rows] = grad.to(hidden.dtype) @ weight
                    if grad_weight is not None:
                        grad_weight.addmm_(grad.T, hidden[rows].to(acc))
                    if grad_bias is not None:
                        grad_bias += grad.sum(0)
                    del grad
                del logits, target, t  # the chunk's logits go before the next chunk's are made
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        out = tuple(None if g is None else g.mul_(grad_total).to(dtype) for g, dtype in zip(ctx.grads, ctx.dtypes))
        ctx.grads = None  # freed as they are handed over
        return (*out, None, None, None, None)


def linear_cross_entropy_sum(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    chunk_tokens: int = 4096,
) -> Tensor:
    """`sum_i CE(F.linear(hidden_i, weight, bias), label_i)`, holding at most `chunk_tokens x vocab` logits.

    Args:
        hidden: `(tokens, dim)`.
        weight: `(vocab, dim)`, the output projection.
        labels: `(tokens,)` integer targets; `ignore_index` tokens add nothing.
        bias: `(vocab,)` or None.
        softcap: final-logit softcapping (Gemma): logits become `softcap * tanh(logits / softcap)`,
            applied in the accumulation dtype.
        chunk_tokens: tokens per chunk.

    Returns:
        A scalar in `accumulation_dtype(hidden.dtype)`, differentiable in hidden, weight and bias.
    """
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, softcap, ignore_index, chunk_tokens)
