"""The CP-aware loss, and the gradient reduction it implies.

Every CP rank sees different tokens of the same sequences, so neither the loss
nor the parameter gradients are complete on any one rank. `cp_cross_entropy`
returns this rank's share of the global mean: the sum of its token losses divided
by the number of valid tokens over the whole dp x cp group. The shares add up to
exactly the single-device mean, and so do their gradients: parameter gradients
must therefore be SUMMED over dp x cp (not averaged, and not skipped over cp:
each cp rank's gradient covers only its own tokens): `gradients.allreduce_gradients`.

`cp_linear_cross_entropy` is the same share computed from the final hidden states and the output
weight, never holding more than a chunk of logits (`chunked_loss.py`); on CUDA a fused kernel
(Liger, Cut Cross-Entropy) takes its place when installed. `_linear_loss_sum` is the one place that
chooses between them.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose import _compat
from cpcompose.comm import CPGroup, all_reduce
from cpcompose.parallel.chunked_loss import linear_cross_entropy_sum
from cpcompose.precision import accumulation_dtype

__all__ = ["LossKernel", "cp_cross_entropy", "cp_linear_cross_entropy", "global_token_count"]

LossKernel = Literal["auto", "torch", "liger", "cut_cross_entropy"]
"""Who computes `cp_linear_cross_entropy`'s token sum: auto (a fused CUDA kernel when installed and able,
else torch), torch (the chunked PyTorch path, any device), or one named CUDA kernel."""

_CUDA_KERNELS = ("liger", "cut_cross_entropy")  # auto's order of preference


def global_token_count(labels: Tensor, mesh: DeviceMesh, *, ignore_index: int = -100) -> Tensor:
    """Valid (non-ignored) labels summed over `mesh` (1-D, e.g. the flattened dp x cp mesh)."""
    count = (labels != ignore_index).sum().to(torch.float32)
    all_reduce(count, CPGroup.from_mesh(mesh).group, op="sum")
    return count


def cp_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    mesh: DeviceMesh,
    ignore_index: int = -100,
    num_tokens: Tensor | float | None = None,
) -> Tensor:
    """This rank's share of the global mean cross-entropy.

    Args:
        logits: `(..., vocab)` for the local tokens.
        labels: `(...)` targets for the same tokens (`ignore_index` = no loss).
        mesh: 1-D mesh over which the valid tokens are counted (dp x cp in training).
        num_tokens: the global count, if already known (pipeline microbatches use it).

    Returns:
        `sum(local token losses) / global valid tokens`, in float32 or wider. The sum of this over
        the mesh is the single-device mean; all-reduce it (SUM) to log it.

    Raises:
        ValueError: logits and labels do not describe the same tokens.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must agree on every dim but "
            "the last (vocab)"
        )
    if num_tokens is None:
        num_tokens = global_token_count(labels, mesh, ignore_index=ignore_index)
    acc = accumulation_dtype(logits.dtype)  # bf16 logits: the loss in float32
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(acc), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    return total / torch.as_tensor(num_tokens, dtype=acc, device=total.device).clamp(min=1)


def cp_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    mesh: DeviceMesh,
    ignore_index: int = -100,
    num_tokens: Tensor | float | None = None,
    softcap: float | None = None,
    bias: Tensor | None = None,
    chunk_tokens: int = 4096,
    kernel: LossKernel = "auto",
) -> Tensor:
    """This rank's share of the global mean cross-entropy of `F.linear(hidden, weight, bias)`, logits never whole.

    Equal to `cp_cross_entropy(F.linear(hidden, weight, bias), labels, ...)` (with the logits softcapped when
    `softcap` is given) but at most `chunk_tokens x vocab` logits exist at once, forward and backward: backward
    recomputes each chunk. Under autocast the inputs are cast to the autocast dtype first, as the unfused
    `nn.Linear` would be; the log-sum-exp, softcapping and the weight gradient's sum over chunks run in float32
    (float64 for float64 inputs).

    Args:
        hidden: `(..., dim)` final hidden states of the local tokens (after the final norm).
        weight: `(vocab, dim)`, the output projection's weight.
        labels: `(...)` targets for the same tokens (`ignore_index` = no loss).
        mesh: 1-D mesh over which the valid tokens are counted (dp x cp in training).
        num_tokens: the global count, if already known.
        softcap: final-logit softcapping, Gemma's: logits become `softcap * tanh(logits / softcap)`.
        bias: `(vocab,)` output bias, if the head has one.
        chunk_tokens: tokens per chunk of the PyTorch path (the CUDA kernels choose their own).
        kernel: see `LossKernel`. A named CUDA kernel refuses what it cannot do (CPU tensors, float64,
            not installed) with a ValueError instead of falling back.

    Returns:
        `sum(local token losses) / global valid tokens`, in float32 or wider; the shares sum to the global mean.

    Raises:
        ValueError: shapes that do not describe one head over the same tokens, a non-positive `chunk_tokens` or
            `softcap`, or a kernel that cannot run these inputs.
    """
    _check_head(hidden, weight, labels, bias=bias, softcap=softcap, chunk_tokens=chunk_tokens)
    if num_tokens is None:
        num_tokens = global_token_count(labels, mesh, ignore_index=ignore_index)
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    total = _linear_loss_sum(
        kernel, hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), bias=bias, softcap=softcap,
        ignore_index=ignore_index, chunk_tokens=chunk_tokens,
    )
    return total / torch.as_tensor(num_tokens, dtype=total.dtype, device=total.device).clamp(min=1)


def _check_head(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None, softcap: float | None,
                chunk_tokens: int) -> None:
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree on every dim "
                         "but the last (the model width)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be (vocab, {hidden.shape[-1]}): the output "
                         "projection's weight, as nn.Linear stores it")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be ({weight.shape[0]},), one entry per vocabulary row")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None for no softcapping), got {softcap}")


def _autocast_inputs(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The head's inputs in the dtype autocast would run `nn.Linear` in (unchanged outside autocast)."""
    device = hidden.device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _kernel_problem(kernel: str, hidden: Tensor) -> str | None:
    """Why a CUDA kernel cannot compute this loss, or None."""
    if not hidden.is_cuda:
        return f"it runs on CUDA only, and hidden is on {hidden.device}"
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"it takes float32, bfloat16 or float16, not {hidden.dtype}"
    if _compat.import_fused_linear_cross_entropy(kernel) is None:
        return "it is not installed (pip install 'cpcompose[fused-loss]')"
    return None


def _linear_loss_sum(kernel: LossKernel, hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None,
                     softcap: float | None, ignore_index: int, chunk_tokens: int) -> Tensor:
    """The one dispatch point: the sum of the local token losses, by the kernel asked for (or chosen)."""
    if kernel == "auto":
        kernel = next((k for k in _CUDA_KERNELS if _kernel_problem(k, hidden) is None), "torch")
    if kernel == "torch":
        return linear_cross_entropy_sum(hidden, weight, labels, bias=bias, softcap=softcap,
                                        ignore_index=ignore_index, chunk_tokens=chunk_tokens)
    if kernel not in _CUDA_KERNELS:
        raise ValueError(f"kernel must be one of auto, torch, {', '.join(_CUDA_KERNELS)}; got {kernel!r}")
    problem = _kernel_problem(kernel, hidden)
    if problem is not None:
        raise ValueError(f"kernel={kernel!r} cannot compute this loss: {problem}; use kernel='torch'")
    fn = _compat.import_fused_linear_cross_entropy(kernel)
    kwargs = {"bias": bias, "ignore_index": ignore_index, "softcap": softcap, "reduction": "sum"}
    if kernel == "cut_cross_entropy":
        # filter_eps=None: no gradient filtering, so the gradients are exact; aligned, contiguous targets.
        return fn(hidden, weight, labels.contiguous().clone(), filter_eps=None, **kwargs).to(torch.float32)
    return fn(hidden, weight, labels, **kwargs).to(torch.float32)

