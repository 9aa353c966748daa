"""Blocking collectives on any process group: the trainer's, the checkpoint's, the agreement's error messages.

The rest of cpcompose moves no byte outside this package: its few collectives over
a whole job or one mesh dimension (a loss or token count summed, a stop flag, a
barrier before a checkpoint counts, an error message every rank must print) are
these. Each is the torch call it replaces, blocking, in the caller's order, and
bounded as that call is: by the timeout the group was given (`init_process_group`,
`set_timeout`), which gloo's contexts and NCCL's watchdog read. `group=None` is
every process (the default group). They count no bytes: the meter measures CP.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from cpcompose import _compat

__all__ = [
    "ReduceOp", "all_gather_into", "all_gather_objects", "all_gather_tensors", "all_reduce", "all_to_all_into",
    "barrier", "broadcast", "broadcast_object",
]

ReduceOp = Literal["sum", "max"]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce(x: Tensor, group: dist.ProcessGroup | None = None, *, op: ReduceOp = "sum") -> Tensor:
    """Reduce `x` over `group` in place (every rank ends with the sum or maximum); returns `x`."""
    dist.all_reduce(x, op=_OPS[op], group=group)
    return x


def all_gather_tensors(x: Tensor, group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """Every rank's `x` (same shape on every rank), in rank order."""
    everyone = [torch.zeros_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, x, group=group)
    return everyone


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def broadcast(x: Tensor, *, src: int = 0, group: dist.ProcessGroup | None = None) -> Tensor:
    """Rank `src`'s `x` on every rank, in place; returns `x`."""
    dist.broadcast(x, src=src, group=group)
    return x


def broadcast_object(obj: Any, *, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Rank `src`'s picklable `obj`, returned on every rank (the others' `obj` is ignored)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of `group` has reached this call."""
    dist.barrier(group=group)


def all_gather_into(out: Tensor, x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Every rank's 1-D `x` concatenated into `out`, in rank order, as the bare transport moves it (no staging, no
    meter): what the calibration times (`cpcompose.attention.cost.calibrate`). Returns `out`."""
    _compat.all_gather_flat(out, x, group)
    return out


def all_to_all_into(out: Tensor, x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Equal slices of 1-D `x` to every rank, theirs for this rank into `out`, as the bare transport moves them (no
    staging, no meter): what the calibration times. Returns `out`."""
    _compat.all_to_all_flat(out, x, group)
    return out
