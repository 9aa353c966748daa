"""Token dispatch and combine with every rank's input checked and agreed before any row moves.

comm's token dispatch (`cpcompose.comm.token_dispatch`) is a collective that trusts its
arguments: a bad expert index or a wrong width on one rank would leave the others
waiting in an all-to-all whose sizes no longer match. Here each rank checks its own
input first (`dispatch_error`, `combine_error`) and every rank agrees
(`agree_across_ranks`: one tiny all-gather) on its verdict and on what the exchanges
need equal everywhere (the expert count, the row width, the dtype). A bad input on
one rank raises the same ValueError on every rank before any counts or rows travel,
and the group stays usable for the next call.

The agreement is one blocking all-gather per call, read on the host (on CUDA a device
sync, besides the one dispatch already makes for its splits). An MoE layer that
agrees once for its whole call can use comm's functions directly after it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpcompose.agreement import Signature, agree_across_ranks
from cpcompose.comm import (
    CommMeter,
    CPGroup,
    Dispatched,
    combine_error,
    combine_from_experts,
    dispatch_error,
    dispatch_to_experts,
)

__all__ = ["combine", "dispatch"]


def dispatch(
    rows: Tensor, expert_of_row: Tensor, *, num_experts: int, group: CPGroup, meter: CommMeter | None = None,
) -> Dispatched:
    """Send each row to the rank that holds its expert (experts dealt to ranks in contiguous blocks).

    A collective: every rank of `group` calls it, with the same `num_experts`, row width and dtype.

    Args:
        rows: `(N, width)`, any float dtype; N may differ between ranks, and may be 0. For top-k
            routing repeat each token k times first (`tokens.repeat_interleave(k, 0)`).
        expert_of_row: `(N,)` integer global expert of each row, in `[0, num_experts)`
            (`top_experts.reshape(-1)` for top-k).
        num_experts: the global expert count; rank r holds experts `[r * E/ep, (r + 1) * E/ep)`.
        group: the EP group (`CPGroup.from_mesh(mesh["ep"])`).
        meter: counts the bytes this rank sends.

    Returns:
        `Dispatched`: the received rows ordered by local expert, then source rank, then the
        source's row order; rows per local expert (`expert_counts`, `offsets()`); the routing
        for `combine`. Differentiable with respect to `rows`.

    Raises:
        ValueError: on every rank, before any row moves, if any rank's input is bad (an expert
            index outside `[0, num_experts)`, `num_experts` not divisible by the group's size, an
            index that is not 1-D or not one per row, ...) or the ranks' expert counts, row
            widths or dtypes differ.
    """
    error = dispatch_error(rows, expert_of_row, num_experts=num_experts, world=group.world)
    signature = Signature().int("num_experts", num_experts).int("row width", _width(rows)).dtype("dtype", _dtype(rows))
    agree_across_ranks(group, error, signature.fields, what="token dispatch", device=_device(rows))
    return dispatch_to_experts(rows, expert_of_row, num_experts=num_experts, group=group, meter=meter)


def combine(expert_rows: Tensor, dispatched: Dispatched) -> Tensor:
    """Send the experts' results home: `(N, width_out)` in the caller's original row order.

    A collective over `dispatched.group`: every rank calls it, with the same width and dtype.

    Args:
        expert_rows: `(R, width_out)`, one result per row of `dispatched.rows`, in that order.
        dispatched: what `dispatch` returned on this rank.

    Returns:
        `(N, width_out)`: row i is the result for the caller's row i. Differentiable with
        respect to `expert_rows`.

    Raises:
        ValueError: on every rank, before any row moves, if any rank's `expert_rows` does not
            hold one row per dispatched row, or the ranks' widths or dtypes differ.
    """
    error = combine_error(expert_rows, dispatched)
    signature = Signature().int("row width", _width(expert_rows)).dtype("dtype", _dtype(expert_rows))
    agree_across_ranks(dispatched.group, error, signature.fields, what="token combine",
                       device=dispatched.rows.device)
    return combine_from_experts(expert_rows, dispatched)


def _width(rows: object) -> int | None:
    """The row width every rank must share (None when `rows` is no 2-D tensor: its rank's own check says so)."""
    return rows.shape[1] if isinstance(rows, Tensor) and rows.dim() == 2 else None


def _dtype(rows: object) -> torch.dtype | None:
    return rows.dtype if isinstance(rows, Tensor) else None


def _device(rows: object) -> torch.device:
    """Where the agreement's tiny tensor lives: the rows' device (CUDA for an NCCL group)."""
    return rows.device if isinstance(rows, Tensor) else torch.device("cpu")
