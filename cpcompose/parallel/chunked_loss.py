"""The LM head and cross-entropy fused and chunked over tokens: the logits are never whole.

At a 128k vocabulary the logits of a long local sequence, their float32 copy, the log-softmax
and its gradient cost several times the rest of a step (issue 21). `linear_cross_entropy_sum`
computes `sum_i CE(head(hidden_i), label_i)` a chunk of tokens at a time: forward keeps only the
per-token log-sum-exp; backward recomputes each chunk's logits and turns them into that chunk's
hidden gradient and its share of the weight (and bias) gradient. So one chunk of `chunk_tokens x vocab`
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


def _logsumexp_(z: Tensor) -> Tensor:
    """`torch.logsumexp(z, dim=-1)` by ATen's own steps, but in z's memory (z is overwritten).

    ATen's makes a temporary as large as z (`(z - max).exp_()`), which would double a chunk's peak.
    """
    m = z.amax(dim=-1, keepdim=True)
    m.masked_fill_(m.abs() == float("inf"), 0)  # as ATen: an infinite row's max is taken as 0
    return z.sub_(m).exp_().sum(dim=-1).log_().add_(m.squeeze(-1))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies of `F.linear(hidden, weight, bias)` (optionally softcapped), by chunks."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
        softcap: float | None, ignore_index: int, chunk_tokens: int,
    ) -> Tensor:
        acc = accumulation_dtype(hidden.dtype)
        lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        with _no_autocast(hidden.device.type):
            for start in range(0, hidden.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                logits = _logits(hidden[rows], weight, bias, softcap)[0]  # the tanh is for backward only
                valid = labels[rows] != ignore_index
                target = logits.gather(1, torch.where(valid, labels[rows], 0).unsqueeze(1)).squeeze(1)
                lse[rows] = _logsumexp_(logits)  # overwrites logits: the target was read first
                total += torch.where(valid, lse[rows] - target, 0).sum()
                del logits, target  # the chunk's logits go before the next chunk's are made
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.softcap, ctx.ignore_index, ctx.chunk_tokens = softcap, ignore_index, chunk_tokens
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        acc = lse.dtype
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if want_bias else None
        with _no_autocast(hidden.device.type):
            for start in range(0, hidden.shape[0], ctx.chunk_tokens):
                rows = slice(start, start + ctx.chunk_tokens)
                logits, t = _logits(hidden[rows], weight, bias, ctx.softcap)
                # d(lse - logit_target)/d logits = softmax - onehot(target); ignored tokens contribute nothing.
                grad = logits.sub_(lse[rows].unsqueeze(1)).exp_()
                valid = labels[rows] != ctx.ignore_index
                grad.scatter_add_(1, torch.where(valid, labels[rows], 0).unsqueeze(1),
                                  torch.full_like(lse[rows], -1.0).unsqueeze(1))
                grad.mul_((valid.to(acc) * grad_total).unsqueeze(1))
                if t is not None:  # through softcap * tanh(z / softcap): times 1 - tanh^2
                    grad.mul_(t.mul_(t).neg_().add_(1))
                    del t
                if grad_hidden is not None:  # rounded to the inputs' dtype first, as the unfused backward does
                    grad_hidden[rows] = grad.to(hidden.dtype) @ weight
                if grad_weight is not None:
                    grad_weight.addmm_(grad.T, hidden[rows].to(acc))
                if grad_bias is not None:
                    grad_bias += grad.sum(0)
                del grad, logits  # grad is logits, changed in place: both names go before the next chunk
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


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
