"""Fetching rows of the global sequence from whichever ranks hold them, differentiably.

A mixer that reads a few positions outside a rank's runs (a causal conv's last
width-1 tokens before each run) asks for them by global position. Every rank's
request is computed from the layout, identically on every rank, so each rank
knows what to send to whom without a metadata exchange: one all-to-all with
uneven (often zero) splits moves the rows, positions a rank holds itself are
copied locally, and the backward sends each row's gradient back to its owner,
which adds it there.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from cpcompose.comm import CommMeter, CPGroup, start_all_to_all_pieces
from cpcompose.layouts import Layout

__all__ = [
    "FetchPlan", "PostedFetch", "assemble_rows", "fetch_positions", "plan_fetch", "post_fetch", "post_gradients_home",
    "send_gradients_home",
]


@dataclass(frozen=True)
class FetchPlan:
    """Which local rows this rank sends to each peer, and where the rows it receives land."""

    send_rows: tuple[Tensor, ...]  # per peer: local rows to send it, in the order it asked (empty for self)
    recv_slots: tuple[Tensor, ...]  # per peer: output slots of the rows it sends here (empty for self)
    local_rows: Tensor  # rows of asked positions this rank holds itself ...
    local_slots: Tensor  # ... and their output slots
    count: int  # positions this rank asked for
    moves: bool  # whether any rank sends to another (the same answer on every rank)


def plan_fetch(
    layout: Layout, seq_len: int, wanted: Sequence[Sequence[int]], rank: int, device: torch.device
) -> FetchPlan:
    """Plan `rank`'s part of the exchange in which rank d receives the rows at global positions `wanted[d]`."""
    held = sorted((run.pos, run.length, r, run.row) for r in range(layout.world) for run in layout.runs(r, seq_len))
    starts = [pos for pos, _, _, _ in held]
    world = layout.world
    send: list[list[int]] = [[] for _ in range(world)]
    slots: list[list[int]] = [[] for _ in range(world)]
    local_rows: list[int] = []
    local_slots: list[int] = []
    moves = False
    for dst, positions in enumerate(wanted):
        for slot, p in enumerate(positions):
            pos, length, src, row = held[bisect.bisect_right(starts, p) - 1]
            if not 0 <= p - pos < length:
                raise ValueError(f"global position {p} is outside the sequence of {seq_len} tokens")
            moves |= src != dst
            if src == dst == rank:
                local_rows.append(row + p - pos)
                local_slots.append(slot)
            elif src == rank:
                send[dst].append(row + p - pos)
            elif dst == rank:
                slots[src].append(slot)

    def index(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return FetchPlan(
        tuple(map(index, send)), tuple(map(index, slots)), index(local_rows), index(local_slots),
        len(wanted[rank]), moves,
    )


def _start_exchange(
    src: Tensor, take: Sequence[Tensor], give: Sequence[Tensor], rest: torch.Size, cp: CPGroup,
    meter: CommMeter | None,
) -> Callable[[], list[Tensor]]:
    """Post sending `src[:, take[d]]` to each rank d; `wait()` gives, from each rank s, as many rows as `give[s]`."""
    batch = src.shape[0]
    send = [[src[:, rows]] for rows in take]  # indexing, not index_select: see `_Arrived`
    shapes = [[torch.Size((batch, len(where), *rest))] for where in give]
    wait = start_all_to_all_pieces(send, shapes, cp, meter)
    return lambda: [pieces[0] for pieces in wait()]


class _Arrived(torch.autograd.Function):
    """The fetched rows (this rank's own copied, the others' already received) in `x`'s graph; the backward
    sends each row's gradient back to its owner, which adds it there.

    `x` is often a transposed view (a conv's channels-first input seen as `(batch, seq, channels)`): its rows
    are read by indexing, which copies only them, where `index_select` on a strided dim copies the whole
    shard first; and its gradient is laid out as `x` is, so adding it to the conv's needs no transpose.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, plan: FetchPlan, cp: CPGroup, meter: CommMeter | None,
                *received: Tensor) -> Tensor:
        ctx.plan, ctx.cp, ctx.meter = plan, cp, meter
        ctx.save_for_backward(x)  # for its shape and memory layout only
        return assemble_rows(x, plan, list(received))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        plan, (x,) = ctx.plan, ctx.saved_tensors
        grad_x = torch.zeros_like(x, dtype=grad.dtype)
        send_gradients_home(grad, plan, grad_x, ctx.cp, ctx.meter)
        return (grad_x, None, None, None, *([None] * len(plan.recv_slots) if plan.moves else []))


def assemble_rows(x: Tensor, plan: FetchPlan, received: list[Tensor]) -> Tensor:
    """The asked rows in order, `(batch, plan.count, ...)`: this rank's own copied from `x`, the others' as received
    (outside autograd: `PostedFetch.rows` puts them in `x`'s graph, a caller with its own backward uses
    `send_gradients_home`)."""
    out = x.new_zeros((x.shape[0], plan.count, *x.shape[2:]))
    out.index_copy_(1, plan.local_slots, x[:, plan.local_rows])
    for where, rows in zip(plan.recv_slots, received):
        out.index_copy_(1, where, rows)
    return out


def send_gradients_home(grad: Tensor, plan: FetchPlan, grad_x: Tensor, cp: CPGroup, meter: CommMeter | None) -> None:
    """The fetch's backward: adds the gradient of each asked row (`grad`, `(batch, plan.count, ...)`) to its owner's
    `grad_x` (`x`'s shape; this rank's rows here, the others' after the forward's exchange reversed). A collective
    when the fetch moved rows: every rank calls it."""
    post_gradients_home(grad, plan, cp, meter)(grad_x)


def post_gradients_home(
    grad: Tensor, plan: FetchPlan, cp: CPGroup, meter: CommMeter | None
) -> Callable[[Tensor], None]:
    """`send_gradients_home` posted: the exchange starts now, the returned `add(grad_x)` waits for it and adds, so
    a backward computes the rest of `x`'s gradient while the fetched rows' gradients travel."""
    returned = (_start_exchange(grad, plan.recv_slots, plan.send_rows, grad.shape[2:], cp, meter)
                if plan.moves else None)  # the forward's exchange reversed: each row's gradient goes home

    def add(grad_x: Tensor) -> None:
        grad_x.index_add_(1, plan.local_rows, grad.index_select(1, plan.local_slots))
        for rows, g in zip(plan.send_rows, returned() if returned is not None else []):
            grad_x.index_add_(1, rows, g)

    return add


class PostedFetch:
    """A fetch in flight (`post_fetch`): `rows()` waits for it and gives the rows, differentiable w.r.t. `x`."""

    def __init__(self, x: Tensor, plan: FetchPlan, cp: CPGroup, meter: CommMeter | None) -> None:
        self.x, self.plan, self.cp, self.meter = x, plan, cp, meter
        self.wait = (_start_exchange(x.detach(), plan.send_rows, plan.recv_slots, x.shape[2:], cp, meter)
                     if plan.moves else None)

    def received(self) -> list[Tensor]:
        """The rows from each peer (waits for them), outside autograd."""
        return self.wait() if self.wait is not None else []

    def rows(self) -> Tensor:
        return _Arrived.apply(self.x, self.plan, self.cp, self.meter, *self.received())  # type: ignore[no-any-return]


def post_fetch(
    x: Tensor, wanted: Sequence[Sequence[int]], *, cp: CPGroup, layout: Layout, seq_len: int,
    meter: CommMeter | None = None,
) -> PostedFetch:
    """`fetch_positions` posted: compute what does not read the rows while they travel, then `.rows()`."""
    return PostedFetch(x, plan_fetch(layout, seq_len, wanted, cp.rank, x.device), cp, meter)


def fetch_positions(
    x: Tensor, wanted: Sequence[Sequence[int]], *, cp: CPGroup, layout: Layout, seq_len: int,
    meter: CommMeter | None = None,
) -> Tensor:
    """The rows of the global sequence at positions `wanted[cp.rank]`, from whichever ranks hold them.

    A collective: every rank calls it with the same `wanted` (every rank's request,
    computed from the layout) and, if it needs gradients, runs the backward. It does
    not check its arguments across ranks; public entry points agree first.

    Args:
        x: this rank's shard, `(batch, seq_local, ...)`, its runs in increasing position.
        wanted: `wanted[d]` are the global positions rank d asks for (any order, repeats allowed).
        cp: the CP group; `layout.world` ranks.
        layout: the split `x` was cut by; `seq_len`: the global sequence length.
        meter: counts the bytes sent (the forward's rows and the backward's gradients).

    Returns:
        `(batch, len(wanted[cp.rank]), ...)`, differentiable with respect to `x` on every rank.
    """
    return post_fetch(x, wanted, cp=cp, layout=layout, seq_len=seq_len, meter=meter).rows()
