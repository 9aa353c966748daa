"""The CP-aware loss, and the gradient reduction it implies.

Every CP rank sees different tokens of the same sequences, so neither the loss
nor the parameter gradients are complete on any one rank. `cp_cross_entropy`
returns this rank's share of the global mean: the sum of its token losses divided
by the number of valid tokens over the whole dp x cp group. The shares add up to
exactly the single-device mean, and so do their gradients: parameter gradients
must therefore be SUMMED over dp x cp (not averaged, and not skipped over cp:
each cp rank's gradient covers only its own tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cpcompose.comm import CPGroup
from cpcompose.precision import accumulation_dtype

__all__ = ["allreduce_gradients", "cp_cross_entropy", "global_token_count"]


def global_token_count(labels: Tensor, mesh: DeviceMesh, *, ignore_index: int = -100) -> Tensor:
    """Valid (non-ignored) labels summed over `mesh` (1-D, e.g. the flattened dp x cp mesh)."""
    count = (labels != ignore_index).sum().to(torch.float32)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=CPGroup.from_mesh(mesh).group)
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


def allreduce_gradients(module: nn.Module, mesh: DeviceMesh) -> None:
    """Sum parameter gradients over `mesh` (dp x cp) for parameters FSDP does not reduce.

    One flat all-reduce per dtype; DTensor (e.g. TP) gradients reduce their local shards.
    """
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    group = CPGroup.from_mesh(mesh).group
    for dtype in {g.dtype for g in locals_}:
        same = [g for g in locals_ if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for g, reduced in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(reduced.view_as(g))
