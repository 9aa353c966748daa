"""Grouped: a layout seen through blocks of consecutive ranks, one "rank" per block.

The 2-D strategy (`cpcompose.attention.strategies.alltoall_ring`) trades heads for sequence inside
blocks of `size` consecutive CP ranks; afterwards each rank of block g holds, for
its heads, the tokens of every member of block g. That union is itself a split of
the sequence over `world / size` blocks, so it is a `Layout`: the ring across
blocks is then the ordinary ring over this layout (its block plans, its halo rows,
its byte counts), with nothing written twice.

A block's tokens are kept in increasing global position (local order is global
order, as for every layout), and adjacent pieces of one document merge into one
run: a zigzag block of ranks 0..a-1 is two runs, like a zigzag rank's.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from cpcompose.layouts.base import Layout, Run, stable_code

__all__ = ["GroupedLayout", "grouped"]


class GroupedLayout(Layout):
    """`base` (over P ranks) seen as `P // size` blocks of `size` consecutive ranks; make it with `grouped`."""

    name = "grouped"

    def __init__(self, base: Layout, size: int) -> None:
        if size < 1 or base.world % size:
            raise ValueError(f"a block of {size} ranks does not divide the {base.world} ranks of {base!r}")
        self.base, self.size, self.world = base, size, base.world // size
        self._identity = stable_code(self.name, base.identity, size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GroupedLayout) and other.identity == self.identity

    def __hash__(self) -> int:
        return self._identity

    def __repr__(self) -> str:
        return f"GroupedLayout({self.base!r}, size={self.size})"

    @property
    def identity(self) -> int:
        return self._identity

    @property
    def keeps_global_order(self) -> bool:
        """Blocks of consecutive ranks of an in-order split are in order; one block holds everything."""
        return self.base.keeps_global_order or self.world == 1

    def members(self, block: int) -> range:
        """The ranks of the base layout that make up `block`."""
        return range(block * self.size, (block + 1) * self.size)

    def runs(self, rank: int, seq_len: int) -> list[Run]:
        return list(_block_runs(self, rank, seq_len))

    def global_runs(self, seq_len: int) -> list[Run]:
        return self.base.global_runs(seq_len)

    def split_error(self, seq_len: int, what: str = "sequence length") -> str | None:
        return self.base.split_error(seq_len, what)

    def position_ids(self, rank: int, seq_len: int, device: torch.device | str | None = None) -> Tensor:
        member = torch.cat([self.base.position_ids(m, seq_len, device) for m in self.members(rank)])
        return member.index_select(0, self.from_member_order(rank, seq_len, device))

    def from_member_order(self, block: int, seq_len: int, device: torch.device | str | None = None) -> Tensor:
        """Index that reorders the members' tokens, concatenated in member order, into this block's order."""
        return _member_index(self, block, seq_len, torch.device(device or "cpu"), False)

    def to_member_order(self, block: int, seq_len: int, device: torch.device | str | None = None) -> Tensor:
        """The inverse of `from_member_order`."""
        return _member_index(self, block, seq_len, torch.device(device or "cpu"), True)


@functools.lru_cache(maxsize=256)
def grouped(base: Layout, size: int) -> GroupedLayout:
    """The `GroupedLayout` of `base` in blocks of `size`, made once (its identity hashes the base's)."""
    return GroupedLayout(base, size)


@functools.lru_cache(maxsize=256)
def _block_runs(layout: GroupedLayout, block: int, seq_len: int) -> tuple[Run, ...]:
    """The members' runs sorted by position, adjacent pieces of one document merged, rows renumbered."""
    pieces = sorted(
        (r.pos, r.length, r.doc) for m in layout.members(block) for r in layout.base.runs(m, seq_len)
    )
    runs: list[Run] = []
    row = 0
    for pos, length, doc in pieces:
        last = runs[-1] if runs else None
        if last is not None and last.doc == doc and last.pos + last.length == pos:
            runs[-1] = Run(last.row, last.pos, last.length + length, doc)
        else:
            runs.append(Run(row, pos, length, doc))
        row += length
    return tuple(runs)


@functools.lru_cache(maxsize=256)
def _member_index(layout: GroupedLayout, block: int, seq_len: int, device: torch.device, inverse: bool) -> Tensor:
    """Built once per block, length and device (a packed layout's pieces make it host work). Read-only."""
    positions = torch.cat([layout.base.local_indices(m, seq_len, device) for m in layout.members(block)])
    order = torch.argsort(positions)
    return torch.argsort(order) if inverse else order
