"""The `Layout` protocol: how one global sequence is dealt to the ranks of a CP group.

Everything cpcompose does with a sequence split (sharding and unsharding tensors,
RoPE positions, the attention's block plans, the all-to-all's reordering, the
cross-rank agreement) asks the layout object and nothing else, so a new split is
one subclass in one file plus one registry line (see `registry.py`).

A rank's local tensor is its pieces of the sequence concatenated in increasing
global position, so local order is always global order. "Layout order" (also
called rank-major order) is the concatenation of rank 0's tokens, rank 1's, ...:
what an all-gather of the shards returns, and the global sequence of a CP DTensor
(see `cpcompose.sharding.cp_distribute`).
"""

from __future__ import annotations

import functools
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Layout", "Run", "stable_code"]


@dataclass(frozen=True)
class Run:
    """`length` consecutive positions from `pos`, all in document `doc`, stored from local row `row`."""

    row: int
    pos: int
    length: int
    doc: int


def stable_code(*parts: object) -> int:
    """A 56-bit integer from `repr(parts)`, equal in every process (unlike the salted `hash()`)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


class Layout(ABC):
    """A split of a sequence over `world` CP ranks; pure index arithmetic, no communication."""

    name: str
    world: int

    # --- what a subclass defines ---

    @abstractmethod
    def runs(self, rank: int, seq_len: int) -> list[Run]:
        """`rank`'s tokens as runs over its local rows (what the block planner reads)."""

    @abstractmethod
    def global_runs(self, seq_len: int) -> list[Run]:
        """The whole sequence in global order, one run per document."""

    @abstractmethod
    def split_error(self, seq_len: int, what: str = "sequence length") -> str | None:
        """Why `seq_len` global tokens cannot be split by this layout, or None."""

    @property
    @abstractmethod
    def identity(self) -> int:
        """A stable code of the whole split: equal across processes iff the splits are equal."""

    def position_ids(self, rank: int, seq_len: int, device: torch.device | str | None = None) -> Tensor:
        """Positions of `rank`'s tokens for RoPE (global positions unless documents restart them)."""
        return self.local_indices(rank, seq_len, device)

    # --- derived from the runs ---

    @property
    def tag(self) -> str:
        """A short printable name of the split (names a CP DTensor's mesh dimension)."""
        return f"{self.name}-{self.identity:014x}"

    @property
    def keeps_global_order(self) -> bool:
        """True if layout order is global order (e.g. contiguous chunks): plain DTensors mean the same."""
        return False

    def check_split(self, seq_len: int, what: str = "sequence length") -> None:
        """Raise ValueError if `seq_len` cannot be split (see `split_error`)."""
        error = self.split_error(seq_len, what)
        if error:
            raise ValueError(error)

    def local_len_error(self, local_len: int) -> str | None:
        """Why `local_len` tokens cannot be one rank's shard, or None."""
        return self.split_error(local_len * self.world, what=f"global length (local {local_len} x {self.world} ranks)")

    def local_indices(self, rank: int, seq_len: int, device: torch.device | str | None = None) -> Tensor:
        """Global positions of the tokens `rank` holds, in local order."""
        self.check_split(seq_len)
        return torch.cat([torch.arange(r.pos, r.pos + r.length, device=device) for r in self.runs(rank, seq_len)])

    def rank_major_order(self, seq_len: int, device: torch.device | str | None = None) -> Tensor:
        """Global positions of layout order: rank 0's tokens, then rank 1's, ..."""
        return torch.cat([self.local_indices(r, seq_len, device) for r in range(self.world)])

    # --- moving tensors (subclasses may do it faster) ---

    def shard(self, x: Tensor, dim: int, rank: int) -> Tensor:
        """`rank`'s part of a full-sequence tensor (a copy)."""
        return x.index_select(dim, self.local_indices(rank, x.shape[dim], x.device))

    def to_global_order(self, x: Tensor, dim: int) -> Tensor:
        """Reorder a layout-order tensor (as all-gather returns it) into global order."""
        return x.index_select(dim, _order_index(self, x.shape[dim], x.device, True))

    def to_rank_major(self, x: Tensor, dim: int) -> Tensor:
        """Reorder a global-order tensor into layout order."""
        return x.index_select(dim, _order_index(self, x.shape[dim], x.device, False))


@functools.lru_cache(maxsize=64)
def _order_index(layout: Layout, seq_len: int, device: torch.device, inverse: bool) -> Tensor:
    """The permutation into layout order (or back), built once per layout, length and device.

    The all-gather and all-to-all strategies reorder K/V on every call; rebuilding the
    index from a packed layout's pieces each time is pure host work. Read-only.
    """
    order = layout.rank_major_order(seq_len, device)
    return torch.argsort(order) if inverse else order
