"""Fetching rows from the ranks that own them, differentiably: the one row fetch cpcompose has.

A causal conv reads the width-1 positions before each of a rank's runs (its halo);
indexer-selected attention reads the K/V rows its queries selected. Both fetch rows
of the global sequence from their owners, and both send each row's gradient back
to its owner, which adds it to its own rows' gradient (`index_add`).

A `FetchPlan` says which local rows this rank sends each peer and where the rows it
receives land. It comes from every rank's request when every rank can compute them
all from the layout (`plan_fetch`: the conv's halo; no metadata exchange), or from
the rows each peer asked for, after the caller exchanged the requests
(`plan_by_peer`: the selected rows). One all-to-all with uneven (often zero) splits
moves the rows (`start_all_to_all_pieces`: its meter, its bounded wait); rows a rank
holds itself are copied locally; the backward is the same exchange reversed, posted
by every rank in the same order.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from cpcompose.comm.collectives import start_all_to_all_pieces
from cpcompose.comm.group import CPGroup
from cpcompose.comm.meter import CommMeter
from cpcompose.layouts import Layout

__all__ = [
    "FetchPlan", "PostedFetch", "assemble_rows", "fetch_positions", "fetch_rows", "plan_by_peer", "plan_fetch",
    "post_fetch", "post_gradients_home", "send_gradients_home",
]


@dataclass(frozen=True)
class FetchPlan:
    """Which local rows this rank sends to each peer, and where the rows it receives land.

    A row is a slice of `x` along `row_dim` (1 for `(batch, seq_local, ...)`; 0 for a flat `(rows, width)`).
    """

    send_rows: tuple[Tensor, ...]  # per peer: local rows to send it, in the order it asked (empty for self)
    recv_slots: tuple[Tensor, ...]  # per peer: output slots of the rows it sends here (empty for self)
    local_rows: Tensor  # rows of asked positions this rank holds itself ...
    local_slots: Tensor  # ... and their output slots
    count: int  # rows this rank asked for
    moves: bool  # whether any rank sends to another (the same answer on every rank)
    row_dim: int = 1


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


def plan_by_peer(send_rows: Sequence[Tensor], recv_counts: Sequence[int], *, moves: bool, row_dim: int) -> FetchPlan:
    """The plan when the caller knows what each peer asked for: `send_rows[d]`, the local rows rank d asked for
    (in its order); `recv_counts[s]`, how many rows rank s sends here. They land side by side, in rank order.

    `moves` must be the same on every rank (from a table every rank holds): when it is False no exchange runs.
    """
    device = send_rows[0].device
    ends = [0, *itertools.accumulate(recv_counts)]
    slots = tuple(torch.arange(a, b, device=device) for a, b in zip(ends, ends[1:]))
    none = torch.empty(0, dtype=torch.long, device=device)
    return FetchPlan(tuple(send_rows), slots, none, none, ends[-1], moves, row_dim)


def _rows_of(x: Tensor, rows: Tensor, dim: int) -> Tensor:
    """`x`'s rows `rows` along `dim`, by indexing (which copies only them, where `index_select` on a strided
    dim copies the whole shard first)."""
    return x[(slice(None),) * dim + (rows,)]


def _start_exchange(
    src: Tensor, take: Sequence[Tensor], give: Sequence[Tensor], dim: int, cp: CPGroup, meter: CommMeter | None,
) -> Callable[[], list[Tensor]]:
    """Post sending `src`'s rows `take[d]` to each rank d; `wait()` gives, from each rank s, as many rows as
    `give[s]` (shaped as `src` but for `dim`)."""
    send = [[_rows_of(src, rows, dim)] for rows in take]
    shapes = [[torch.Size((*src.shape[:dim], len(where), *src.shape[dim + 1:]))] for where in give]
    wait = start_all_to_all_pieces(send, shapes, cp, meter)
    return lambda: [pieces[0] for pieces in wait()]


class _Arrived(torch.autograd.Function):
    """The fetched rows (this rank's own copied, the others' already received) in `x`'s graph; the backward
    sends each row's gradient back to its owner, which adds it there.

    `x` is often a transposed view (a conv's channels-first input seen as `(batch, seq, channels)`): its
    gradient is laid out as `x` is, so adding it to the conv's needs no transpose. Only `x`'s layout is kept
    for the backward (a meta tensor), not `x`.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, plan: FetchPlan, cp: CPGroup, meter: CommMeter | None,
                *received: Tensor) -> Tensor:
        ctx.plan, ctx.cp, ctx.meter = plan, cp, meter
        ctx.layout_of_x, ctx.device = torch.empty_like(x, device="meta"), x.device
        return assemble_rows(x, plan, list(received))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        plan = ctx.plan
        grad_x = torch.zeros_like(ctx.layout_of_x, dtype=grad.dtype, device=ctx.device)
        send_gradients_home(grad, plan, grad_x, ctx.cp, ctx.meter)
        return (grad_x, None, None, None, *([None] * len(plan.recv_slots) if plan.moves else []))


def assemble_rows(x: Tensor, plan: FetchPlan, received: list[Tensor]) -> Tensor:
    """The asked rows in order (`x`'s shape with `plan.count` rows): this rank's own copied from `x`, the others'
    as received (outside autograd: `PostedFetch.rows` puts them in `x`'s graph, a caller with its own backward
    uses `send_gradients_home`)."""
    dim = plan.row_dim
    out = x.new_zeros((*x.shape[:dim], plan.count, *x.shape[dim + 1:]))
    out.index_copy_(dim, plan.local_slots, _rows_of(x, plan.local_rows, dim))
    for where, rows in zip(plan.recv_slots, received):
        out.index_copy_(dim, where, rows)
    return out


def send_gradients_home(grad: Tensor, plan: FetchPlan, grad_x: Tensor, cp: CPGroup, meter: CommMeter | None) -> None:
    """The fetch's backward: adds the gradient of each asked row (`grad`, shaped as the fetched rows) to its
    owner's `grad_x` (`x`'s shape; this rank's rows here, the others' after the forward's exchange reversed).
    A collective when the fetch moved rows: every rank calls it."""
    post_gradients_home(grad, plan, cp, meter)(grad_x)


def post_gradients_home(
    grad: Tensor, plan: FetchPlan, cp: CPGroup, meter: CommMeter | None
) -> Callable[[Tensor], None]:
    """`send_gradients_home` posted: the exchange starts now, the returned `add(grad_x)` waits for it and adds, so
    a backward computes the rest of `x`'s gradient while the fetched rows' gradients travel.

    The addition is one `index_add_` over this rank's own rows then each peer's, in rank order: a row several
    ranks fetched gets its gradients summed in one call, in the same order on every run.
    """
    dim = plan.row_dim
    returned = (_start_exchange(grad, plan.recv_slots, plan.send_rows, dim, cp, meter)
                if plan.moves else None)  # the forward's exchange reversed: each row's gradient goes home

    def add(grad_x: Tensor) -> None:
        arrived = returned() if returned is not None else []
        rows = [plan.local_rows, *(plan.send_rows if returned is not None else ())]
        grads = [grad.index_select(dim, plan.local_slots), *arrived]
        grad_x.index_add_(dim, torch.cat(rows), torch.cat(grads, dim))

    return add


class PostedFetch:
    """A fetch in flight (`post_fetch`): `rows()` waits for it and gives the rows, differentiable w.r.t. `x`."""

    def __init__(self, x: Tensor, plan: FetchPlan, cp: CPGroup, meter: CommMeter | None) -> None:
        self.x, self.plan, self.cp, self.meter = x, plan, cp, meter
        self.wait = (_start_exchange(x.detach(), plan.send_rows, plan.recv_slots, plan.row_dim, cp, meter)
                     if plan.moves else None)

    def received(self) -> list[Tensor]:
        """The rows from each peer (waits for them), outside autograd."""
        return self.wait() if self.wait is not None else []

    def rows(self) -> Tensor:
        return _Arrived.apply(self.x, self.plan, self.cp, self.meter, *self.received())  # type: ignore[no-any-return]


def fetch_rows(x: Tensor, plan: FetchPlan, cp: CPGroup, meter: CommMeter | None = None) -> Tensor:
    """The rows `plan` names, differentiable w.r.t. `x` on every rank; a collective when `plan.moves`."""
    return PostedFetch(x, plan, cp, meter).rows()


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
