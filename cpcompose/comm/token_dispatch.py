"""Token dispatch and combine for expert parallelism: each row to the rank that holds its expert, and back.

A mixture-of-experts layer under expert parallelism (EP) deals its `num_experts`
global experts to the `ep` ranks of a group in contiguous blocks: rank r holds
experts `[r * E/ep, (r + 1) * E/ep)`. Each rank routes its own rows (one row per
(token, chosen expert) pair) and sends every row to its expert's owner; the owner
runs its experts on what arrived and sends the results back, where they land in the
caller's original row order. No row is dropped and no capacity factor exists: the
splits are whatever the routing gives, uneven and possibly zero.

Two collectives, as torchtitan's token dispatcher runs them: first the per-expert
counts travel (an all-to-all of int64 counts, `E/ep` per peer), so each rank knows
how many rows it receives from each peer for each of its experts; one host sync
turns the counts into the splits; then the rows travel (one uneven all-to-all,
`start_all_to_all_rows`). Combine is that row exchange reversed, with the same
splits: no counts and no host sync. Both are differentiable, and each one's
backward is the other's forward on the gradients. So every rank posts the same
collectives in the same order: dispatch's counts, dispatch's rows, combine's rows,
then in the backward combine's mirror and dispatch's mirror.

The rows a rank receives are ordered by local expert, then by source rank, then by
the source's original row order: each expert's rows are one contiguous block
(`Dispatched.expert_counts`, `Dispatched.offsets()` for a grouped GEMM), and the
order is a function of the routing alone, the same on every run. A rank whose
experts receive no row gets a `(0, width)` tensor and still takes part in every
collective; its experts run on an empty input, which gives their weights zero
gradients (a grouped GEMM or a matmul on zero rows does).

Top-k routing sends each token to k experts: repeat each token k times before
dispatch, token-major (`rows = tokens.repeat_interleave(k, 0)`,
`expert_of_row = top_experts.reshape(-1)`, with `top_experts` of shape `(T, k)`);
the combined rows come back in that order, `combined.view(T, k, -1)`, ready for the
router's weighted sum.

These are collectives: every rank of the group calls them with the same `num_experts`,
row width and dtype, and, if any rank needs gradients, every rank runs the backward
through both. They do not check their arguments across ranks: public entry points
check each rank's input with `dispatch_error` and agree first (`cpcompose.experts`).
Every wait is bounded by the group's timeout, and the meter counts the bytes this
rank sends: the counts and the rows (forward), the gradients (backward).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpcompose.comm.collectives import start_all_to_all_rows
from cpcompose.comm.group import CPGroup
from cpcompose.comm.meter import CommMeter
from cpcompose.comm.rehearsal import rehearsing

__all__ = ["Dispatched", "combine_from_experts", "combine_error", "dispatch_error", "dispatch_to_experts"]


@dataclass(frozen=True, eq=False)
class _Route:
    """Where every row goes and comes back: the permutations and the splits of one dispatch."""

    group: CPGroup
    meter: CommMeter | None
    by_expert: Tensor  # (N,) the caller's rows sorted by global expert: sorted row i is caller row by_expert[i]
    caller_order: Tensor  # (N,) the inverse: caller row k is sorted row caller_order[k]
    expert_major: Tensor  # (R,) received row j (expert-major) is row expert_major[j] of the exchange's buffer
    source_major: Tensor  # (R,) the inverse: buffer row p is received row source_major[p]
    send_rows: tuple[int, ...]  # rows this rank sends each peer
    recv_rows: tuple[int, ...]  # rows each peer sends here


@dataclass(frozen=True, eq=False)
class Dispatched:
    """The rows this rank's experts received, and what `combine_from_experts` needs to send results home."""

    rows: Tensor
    """`(R, width)`: ordered by local expert, then source rank, then the source's original row order."""
    expert_counts: tuple[int, ...]
    """Rows per local expert (`E/ep` of them), in order: `rows.split(expert_counts)` gives each expert's block."""
    first_expert: int
    """The global index of this rank's local expert 0."""
    route: _Route

    @property
    def group(self) -> CPGroup:
        return self.route.group

    def offsets(self, dtype: torch.dtype = torch.int32) -> Tensor:
        """The end of each local expert's block in `rows` (a cumulative sum): `torch._grouped_mm`'s `offs`."""
        return torch.tensor(list(itertools.accumulate(self.expert_counts)), dtype=dtype, device=self.rows.device)


def dispatch_error(rows: Tensor, expert_of_row: Tensor, *, num_experts: int, world: int) -> str | None:
    """Why this rank's input cannot be dispatched over `world` ranks, or None (no communication).

    On CUDA the range check reads the indices' minimum and maximum on the host (one sync).
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        return f"num_experts must be a positive int, got {num_experts!r}"
    if num_experts % world:
        return (f"num_experts ({num_experts}) must be divisible by the group's {world} ranks: each rank holds "
                f"an equal block of experts")
    if not isinstance(rows, Tensor) or rows.dim() != 2 or not rows.is_floating_point():
        return f"rows must be a 2-D floating-point tensor (rows, width), got {_described(rows)}"
    if not isinstance(expert_of_row, Tensor) or expert_of_row.dim() != 1:
        return f"expert_of_row must be a 1-D tensor (one expert per row), got {_described(expert_of_row)}"
    if expert_of_row.is_floating_point() or expert_of_row.is_complex() or expert_of_row.dtype == torch.bool:
        return f"expert_of_row must hold integer expert indices, got dtype {expert_of_row.dtype}"
    if len(expert_of_row) != len(rows):
        return f"expert_of_row has {len(expert_of_row)} entries for {len(rows)} rows: one expert per row"
    if expert_of_row.device != rows.device:
        return f"expert_of_row is on {expert_of_row.device}, rows on {rows.device}"
    if len(expert_of_row) and not rehearsing():  # a rehearsal's indices hold no values
        low, high = torch.stack(torch.aminmax(expert_of_row)).tolist()  # one read of both
        if low < 0 or high >= num_experts:
            return f"expert indices must lie in [0, {num_experts}), got {low}..{high}"
    return None


def combine_error(expert_rows: Tensor, dispatched: Dispatched) -> str | None:
    """Why `expert_rows` cannot be combined (it must hold one result row per dispatched row), or None."""
    if not isinstance(expert_rows, Tensor) or expert_rows.dim() != 2 or not expert_rows.is_floating_point():
        return f"expert_rows must be a 2-D floating-point tensor (rows, width), got {_described(expert_rows)}"
    if len(expert_rows) != len(dispatched.rows):
        return (f"expert_rows has {len(expert_rows)} rows, but this rank's experts received "
                f"{len(dispatched.rows)}: one result row per dispatched row, in the dispatched order")
    if expert_rows.device != dispatched.rows.device:
        return f"expert_rows is on {expert_rows.device}, the dispatched rows on {dispatched.rows.device}"
    return None


def _described(x: object) -> str:
    return f"shape {tuple(x.shape)}, dtype {x.dtype}" if isinstance(x, Tensor) else type(x).__name__


def dispatch_to_experts(
    rows: Tensor, expert_of_row: Tensor, *, num_experts: int, group: CPGroup, meter: CommMeter | None = None,
) -> Dispatched:
    """Send each row to the rank that holds its expert: the counts first, one host sync, then the rows.

    A collective over `group`; the arguments must pass `dispatch_error` on every rank
    and agree across ranks (`num_experts`, the width, the dtype), which this function
    does not check.

    Args:
        rows: `(N, width)`, any float dtype; N may differ between ranks, and may be 0.
        expert_of_row: `(N,)` the global expert of each row, in `[0, num_experts)`.
        num_experts: the global expert count, divisible by `group.world`.
        group: the EP group (a 1-D mesh's group: `CPGroup.from_mesh(mesh["ep"])`).
        meter: counts the bytes sent (counts and rows forward, gradients backward).

    Returns:
        The received rows, expert-major (see `Dispatched.rows`), differentiable with respect
        to `rows` on every rank, with the routing `combine_from_experts` needs.
    """
    route, expert_counts = _route(expert_of_row.long(), num_experts, group, meter)
    received = _ToExperts.apply(rows, route)
    return Dispatched(received, expert_counts, group.rank * len(expert_counts), route)


def combine_from_experts(expert_rows: Tensor, dispatched: Dispatched) -> Tensor:
    """Send the experts' results home: `(N, width_out)` rows in the caller's original row order.

    A collective over the dispatch's group (the row exchange reversed; no counts, no host
    sync); `expert_rows` must pass `combine_error` and have the same width and dtype on
    every rank. Differentiable with respect to `expert_rows`.
    """
    return _FromExperts.apply(expert_rows, dispatched.route)  # type: ignore[no-any-return]


def _route(expert_of_row: Tensor, num_experts: int, group: CPGroup,
           meter: CommMeter | None) -> tuple[_Route, tuple[int, ...]]:
    """Exchange the per-expert counts and derive the splits and permutations (one host sync)."""
    world, device = group.world, expert_of_row.device
    local_experts = num_experts // world
    by_expert = torch.argsort(expert_of_row, stable=True)  # stable: each expert's rows keep the caller's order
    if rehearsing():
        return _even_route(by_expert, num_experts, group, meter)
    counts = torch.bincount(expert_of_row, minlength=num_experts)
    # row s of `received`: how many rows rank s sends to each of this rank's experts
    received = start_all_to_all_rows(counts.view(world, local_experts), [1] * world, [1] * world, group,
                                     meter).wait()
    synced = torch.cat([counts, received.view(-1)]).tolist()  # the one host sync
    sent_counts, recv_counts = synced[:num_experts], synced[num_experts:]
    send_rows = tuple(sum(sent_counts[d * local_experts:(d + 1) * local_experts]) for d in range(world))
    recv_rows = tuple(sum(recv_counts[s * local_experts:(s + 1) * local_experts]) for s in range(world))
    expert_counts = tuple(sum(recv_counts[s * local_experts + e] for s in range(world)) for e in range(local_experts))
    expert_major = _expert_major_order(received.view(world, local_experts), sum(recv_rows))
    route = _Route(group, meter, by_expert, _inverse(by_expert), expert_major, _inverse(expert_major),
                   send_rows, recv_rows)
    return route, expert_counts


def _even_route(by_expert: Tensor, num_experts: int, group: CPGroup,
                meter: CommMeter | None) -> tuple[_Route, tuple[int, ...]]:
    """A rehearsal's route (`comm.rehearsal_mode`: the indices hold no values, the counts cannot be read): the
    routing assumed even. This rank's N rows go to the experts in equal shares (the first N mod E one more), and
    every rank sends as this one does, so each rank receives as many rows as it sends, its local experts'
    shares from every rank. The permutations are the identity: their sizes are what a rehearsal measures."""
    world, local_experts, n = group.world, num_experts // group.world, len(by_expert)
    sent_counts = [n // num_experts + (e < n % num_experts) for e in range(num_experts)]
    send_rows = tuple(sum(sent_counts[d * local_experts:(d + 1) * local_experts]) for d in range(world))
    mine = sent_counts[group.rank * local_experts:(group.rank + 1) * local_experts]
    recv_rows = (sum(mine),) * world
    identity = torch.arange(n, device=by_expert.device)
    received = torch.arange(sum(recv_rows), device=by_expert.device)
    route = _Route(group, meter, identity, identity, received, received, send_rows, recv_rows)
    return route, tuple(world * count for count in mine)


def _expert_major_order(counts: Tensor, total: int) -> Tensor:
    """The buffer rows in (local expert, source rank, row) order, from `counts[s, e]`: rows rank s sent for
    expert e. The buffer holds them in (source rank, local expert, row) order, as the senders sorted them."""
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view_as(counts)  # each (s, e) block's start
    block_starts, block_counts = starts.T.reshape(-1), counts.T.reshape(-1)  # blocks in (e, s) order
    into_block = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        block_counts.cumsum(0) - block_counts, block_counts, output_size=total)
    return torch.repeat_interleave(block_starts, block_counts, output_size=total) + into_block


def _inverse(permutation: Tensor) -> Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(len(permutation), device=permutation.device)
    return inverse


def _to_experts(x: Tensor, route: _Route) -> Tensor:
    """The caller's rows, sorted by expert, to the experts' owners, then expert-major there."""
    sent = x[route.by_expert]
    arrived = start_all_to_all_rows(sent, route.send_rows, route.recv_rows, route.group, route.meter).wait()
    del sent  # sent: one copy fewer alive while the arrived rows are put in order
    return arrived[route.expert_major]


def _from_experts(y: Tensor, route: _Route) -> Tensor:
    """`_to_experts` reversed: expert-major rows back to source-major, home, then in the caller's order."""
    sent = y[route.source_major]
    arrived = start_all_to_all_rows(sent, route.recv_rows, route.send_rows, route.group, route.meter).wait()
    del sent
    return arrived[route.caller_order]


class _ToExperts(torch.autograd.Function):
    """Dispatch's row exchange; its backward is combine's on the gradients."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, route: _Route) -> Tensor:
        ctx.route = route
        return _to_experts(rows, route)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _from_experts(grad, ctx.route), None


class _FromExperts(torch.autograd.Function):
    """Combine's row exchange; its backward is dispatch's on the gradients."""

    @staticmethod
    def forward(ctx: Any, expert_rows: Tensor, route: _Route) -> Tensor:
        ctx.route = route
        return _from_experts(expert_rows, route)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _to_experts(grad, ctx.route), None
