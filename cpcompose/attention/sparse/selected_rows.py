"""Moving only the K/V rows that queries selected: the request plan for comm's row fetch.

Each rank lists the global rows its queries selected (and may read: causal, same
document) that other ranks own, asks each owner for them (an all-to-all of row ids),
and receives exactly those rows (`cpcompose.comm.fetch_rows`: an all-to-all of rows,
uneven splits). In backward the rows' gradients go back the same way to their owners,
which add them to their own rows' gradients. Every list is sorted by owner rank, then
batch row, then global position, so all ranks build the same exchange whatever the
order of their selections.

A row is one token's K and V of every K/V head, side by side: `(Hk*dk + Hk*dv)` values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cpcompose.comm import CommMeter, CPGroup, FetchPlan, all_gather, all_to_all_pieces, plan_by_peer
from cpcompose.layouts import Layout

__all__ = ["RowPlan", "all_rows_plan", "owners", "selected_rows_plan"]


@dataclass(frozen=True)
class RowPlan:
    """One call's exchange, identical in shape on the two sides of every pair of ranks.

    counts[r][s]: how many rows rank r fetches from rank s (the same table on every rank).
    fetched: `(n,)` flat global ids (`batch * seq_len + position`) of the rows this rank receives, owner-major.
    served: `(m,)` flat local ids (`batch * S_local + local row`) of the rows this rank sends, requester-major.
    """

    counts: tuple[tuple[int, ...], ...]
    fetched: Tensor
    served: Tensor
    rank: int

    def fetch_counts(self) -> list[int]:
        return list(self.counts[self.rank])

    def serve_counts(self) -> list[int]:
        return [row[self.rank] for row in self.counts]

    def route(self) -> FetchPlan:
        """The exchange for `cpcompose.comm.fetch_rows` over this rank's `(B * S_local, width)` rows (dim 0)."""
        moves = any(c for r, row in enumerate(self.counts) for s, c in enumerate(row) if r != s)
        return plan_by_peer(self.served.split(self.serve_counts()), self.fetch_counts(), moves=moves, row_dim=0)


def owners(layout: Layout, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """For each global position: the rank that holds it and its row there."""
    owner = torch.empty(seq_len, dtype=torch.long, device=device)
    local = torch.empty(seq_len, dtype=torch.long, device=device)
    for r in range(layout.world):
        held = layout.local_indices(r, seq_len, device)
        owner[held] = r
        local[held] = torch.arange(held.numel(), device=device)
    return owner, local


def _plan(wanted: Tensor, layout: Layout, seq_len: int, local_len: int, cp: CPGroup,
          meter: CommMeter | None) -> RowPlan:
    """`wanted`: sorted unique flat global ids this rank needs from other ranks."""
    device = wanted.device
    owner, local = owners(layout, seq_len, device)
    position = wanted % seq_len
    by_owner = owner[position]
    order = torch.argsort(by_owner, stable=True)  # owner-major; `wanted` is sorted, so ascending ids within
    wanted, by_owner = wanted[order], by_owner[order]
    mine = torch.bincount(by_owner, minlength=cp.world)
    counts = tuple(tuple(int(c) for c in row) for row in all_gather(mine, cp, meter).tolist())
    asks = [[part] for part in wanted.split(list(counts[cp.rank]))]  # to each owner, the ids wanted from it
    arrived = all_to_all_pieces(asks, [[torch.Size((row[cp.rank],))] for row in counts], cp, meter)
    requests = torch.cat([pieces[0] for pieces in arrived])  # requester-major
    served = (requests // seq_len) * local_len + local[requests % seq_len]
    return RowPlan(counts, wanted, served, cp.rank)


def selected_rows_plan(selected: Tensor, layout: Layout, seq_len: int, cp: CPGroup,
                       meter: CommMeter | None = None) -> RowPlan:
    """The plan for `selected`: `(B, S_local, k)` bool-filtered global positions, -1 where nothing is read."""
    batch = torch.arange(selected.shape[0], device=selected.device).view(-1, 1, 1)
    owner, _ = owners(layout, seq_len, selected.device)
    valid = selected >= 0
    flat = (batch * seq_len + selected.clamp_min(0))[valid]
    remote = owner[flat % seq_len] != cp.rank
    return _plan(torch.unique(flat[remote]), layout, seq_len, selected.shape[1], cp, meter)


def all_rows_plan(batch: int, layout: Layout, seq_len: int, cp: CPGroup, device: torch.device) -> RowPlan:
    """Every row another rank owns (the all-gather's traffic, as one all-to-all); known from the layout alone.

    Owner-major, then batch row, then position: from each owner, its whole shard in its local order.
    """
    owner, _ = owners(layout, seq_len, device)
    remote = torch.nonzero(owner != cp.rank).flatten()
    remote = remote[torch.argsort(owner[remote], stable=True)]
    per_owner = remote.split(torch.bincount(owner[remote], minlength=cp.world).tolist())
    rows = [(torch.arange(batch, device=device)[:, None] * seq_len + part[None, :]).flatten() for part in per_owner]
    local_len = seq_len // layout.world
    counts = tuple(tuple(0 if r == s else batch * local_len for s in range(cp.world)) for r in range(cp.world))
    served = torch.arange(batch * local_len, device=device).repeat(cp.world - 1)
    return RowPlan(counts, torch.cat(rows), served, cp.rank)
