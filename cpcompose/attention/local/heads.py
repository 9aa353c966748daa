"""Trading sequence shards for head shards and back, for any head count (the all-to-all exchange).

Used by the all-to-all strategy over the whole CP group and by the 2-D strategy inside
its blocks of consecutive ranks, so the head split and the GQA rules are written once:

* Query heads are split as evenly as possible (H=10 over 4 ranks gives 3,3,2,2); a
  rank may get none when H is smaller than the group.
* Each rank receives exactly the K/V heads its query heads read: a disjoint split when
  K/V heads divide evenly, else a K/V head goes to each rank that needs it and no
  further. Nothing is expanded to the query head count before the exchange; a rank
  whose query heads straddle K/V groups unevenly expands locally, after communication,
  and sums those gradients back before sending (`HeadPlan`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from cpcompose.comm import CommMeter, CPGroup, all_to_all_pieces
from cpcompose.precision import accumulation_dtype

__all__ = [
    "HeadGroup", "HeadPlan", "HeadRange", "gather_grads", "head_plan", "heads_to_seq", "kv_head_ranges",
    "query_head_ranges", "seq_to_heads",
]

HeadRange = tuple[int, int]


def query_head_ranges(n_heads: int, world: int) -> list[HeadRange]:
    """Contiguous, as-even-as-possible split of `n_heads` over `world` ranks."""
    base, extra = divmod(n_heads, world)
    ranges, lo = [], 0
    for j in range(world):
        hi = lo + base + (1 if j < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def kv_head_ranges(q_ranges: list[HeadRange], group: int) -> list[HeadRange]:
    """The K/V heads each rank's query heads read (`group` query heads per K/V head)."""
    return [(lo // group, (hi - 1) // group + 1) if hi > lo else (0, 0) for lo, hi in q_ranges]


class HeadPlan:
    """Who holds which heads, and how this rank's query heads map to its K/V heads.

    Read-only once built, and built once per (heads, K/V heads, world, rank, device)
    by `head_plan`: the same plan serves every call of every layer.
    """

    def __init__(self, n_heads: int, n_kv: int, world: int, rank: int, device: torch.device) -> None:
        group = n_heads // n_kv
        self.q_ranges = query_head_ranges(n_heads, world)
        self.kv_ranges = kv_head_ranges(self.q_ranges, group)
        (lo, hi), (klo, khi) = self.q_ranges[rank], self.kv_ranges[rank]
        nq, nk = hi - lo, khi - klo
        index = [h // group - klo for h in range(lo, hi)]
        native = nk > 0 and nq % nk == 0 and index == [i // (nq // nk) for i in range(nq)]
        self.kv_index = torch.tensor(index, dtype=torch.int64, device=device)
        self.expand = nq > 0 and not native  # kernel cannot map heads itself

    def local_kv(self, kv: Tensor) -> Tensor:
        return kv.index_select(1, self.kv_index) if self.expand else kv

    def reduce_local_kv(self, dkv: Tensor, n_kv: int) -> Tensor:
        if not self.expand:
            return dkv
        acc = accumulation_dtype(dkv.dtype)
        out = dkv.new_zeros((dkv.shape[0], n_kv, *dkv.shape[2:]), dtype=acc)
        return out.index_add_(1, self.kv_index, dkv.to(acc)).to(dkv.dtype)


@functools.lru_cache(maxsize=256)
def head_plan(n_heads: int, n_kv: int, world: int, rank: int, device: torch.device) -> HeadPlan:
    """The cached `HeadPlan` of this call's head counts."""
    return HeadPlan(n_heads, n_kv, world, rank, device)


class HeadGroup(NamedTuple):
    """The ranks that trade heads for sequence: `size` consecutive CP ranks from `first`, this one at `index`.

    All-to-all attention uses the whole CP group; the 2-D strategy blocks of `alltoall_size`.
    """

    first: int
    size: int
    index: int

    @classmethod
    def of(cls, cp: CPGroup, size: int) -> "HeadGroup":
        """This rank's block of `size` consecutive ranks (`size` divides the group)."""
        return cls(cp.rank - cp.rank % size, size, cp.rank % size)

    @property
    def members(self) -> range:
        return range(self.first, self.first + self.size)


def seq_to_heads(
    tensors: list[Tensor], ranges: list[list[HeadRange]], cp: CPGroup, meter: CommMeter | None, group: HeadGroup
) -> list[Tensor]:
    """Sequence shards `(B, H_i, S, D)` -> head shards `(B, n_i, size * S, D)`: the members' tokens, member order.

    One all-to-all on the CP group; ranks outside `group` get zero-length splits.
    `ranges[i][m]` are the heads of `tensors[i]` that member m gets.
    """
    if group.size == 1:  # every head stays here: nothing to trade
        return [t[:, r[0][0] : r[0][1]].contiguous() for t, r in zip(tensors, ranges)]
    send: list[list[Tensor]] = [[] for _ in range(cp.world)]
    shapes: list[list[torch.Size]] = [[] for _ in range(cp.world)]
    mine = [torch.Size((t.shape[0], r[group.index][1] - r[group.index][0], t.shape[2], t.shape[3]))
            for t, r in zip(tensors, ranges)]
    for m, peer in enumerate(group.members):
        send[peer] = [t[:, r[m][0] : r[m][1]] for t, r in zip(tensors, ranges)]
        shapes[peer] = mine
    recv = all_to_all_pieces(send, shapes, cp, meter)
    return [torch.cat([recv[peer][i] for peer in group.members], dim=2) for i in range(len(tensors))]


def heads_to_seq(
    tensors: list[Tensor], ranges: list[list[HeadRange]], cp: CPGroup, meter: CommMeter | None, group: HeadGroup
) -> list[list[Tensor]]:
    """Head shards, the members' tokens in member order -> per member m, its `(B, n_m, S, D)` piece of our tokens.

    The inverse exchange of `seq_to_heads`; `ranges[i][m]` are the heads member m holds of `tensors[i]`.
    """
    if group.size == 1:
        return [list(tensors)]
    chunks = [t.chunk(group.size, dim=2) for t in tensors]
    seq = tensors[0].shape[2] // group.size
    send: list[list[Tensor]] = [[] for _ in range(cp.world)]
    shapes: list[list[torch.Size]] = [[] for _ in range(cp.world)]
    for m, peer in enumerate(group.members):
        send[peer] = [c[m] for c in chunks]
        shapes[peer] = [torch.Size((t.shape[0], r[m][1] - r[m][0], seq, t.shape[3])) for t, r in zip(tensors, ranges)]
    recv = all_to_all_pieces(send, shapes, cp, meter)
    return [recv[peer] for peer in group.members]


def gather_grads(
    recv: list[list[Tensor]], kv_ranges: list[HeadRange], n_kv: int
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of the local shard from each member's `(dq, dk, dv)` head pieces.

    A K/V head held by several members (fewer K/V heads than members, or uneven
    groups) gets the sum of their gradients, in the accumulation dtype.
    """
    dq = torch.cat([parts[0] for parts in recv], dim=1)
    b, seq = dq.shape[0], dq.shape[2]
    acc_dtype = accumulation_dtype(dq.dtype)
    dk = torch.zeros((b, n_kv, seq, recv[0][1].shape[-1]), dtype=acc_dtype, device=dq.device)
    dv = torch.zeros((b, n_kv, seq, recv[0][2].shape[-1]), dtype=acc_dtype, device=dq.device)
    for (klo, khi), parts in zip(kv_ranges, recv):
        dk[:, klo:khi] += parts[1]
        dv[:, klo:khi] += parts[2]
    return dq, dk.to(dq.dtype), dv.to(dq.dtype)
