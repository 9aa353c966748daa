"""How a global sequence is cut into chunks and dealt to the ranks of a CP group.

`zigzag` cuts the sequence into 2P chunks and gives rank r chunks r and 2P-1-r: an
early and a late chunk, so under a causal mask every rank does the same attention
work. `contiguous` gives rank r chunk r of P: simple, but under a causal mask the
last rank does P-times the work of the first. The local tensor of a rank is its
chunks concatenated in increasing order, so local order is always global order.
This module is pure index arithmetic: no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LayoutName = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


def resolve_layout(layout: str | None, *, is_causal: bool) -> LayoutName:
    """`None` means zigzag for causal attention (balanced), contiguous otherwise.

    Raises:
        ValueError: an unknown layout name.
    """
    if layout is None:
        return "zigzag" if is_causal else "contiguous"
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; choose one of {LAYOUTS}")
    return layout  # type: ignore[return-value]


@dataclass(frozen=True)
class Run:
    """`length` consecutive positions from `pos`, all in document `doc`, stored from local row `row`."""

    row: int
    pos: int
    length: int
    doc: int


@dataclass(frozen=True)
class SeqLayout:
    """A layout over a CP group of `world` ranks."""

    name: LayoutName
    world: int

    @property
    def num_chunks(self) -> int:
        return 2 * self.world if self.name == "zigzag" else self.world

    @property
    def chunks_per_rank(self) -> int:
        return self.num_chunks // self.world

    def chunk_ids(self, rank: int) -> tuple[int, ...]:
        """Global chunk ids held by `rank`, increasing."""
        if self.name == "zigzag":
            return (rank, self.num_chunks - 1 - rank)
        return (rank,)

    def runs(self, rank: int, seq_len: int) -> list[Run]:
        """This rank's chunks as runs of the one document (the whole sequence)."""
        c = seq_len // self.num_chunks
        return [Run(i * c, chunk * c, c, 0) for i, chunk in enumerate(self.chunk_ids(rank))]

    def global_runs(self, seq_len: int) -> list[Run]:
        """The whole sequence in global order: one run."""
        return [Run(0, 0, seq_len, 0)]

    def local_len_error(self, local_len: int) -> str | None:
        """Why `local_len` tokens cannot be one rank's shard, or None."""
        if local_len % self.chunks_per_rank:
            return (
                f"local length {local_len} is not a multiple of {self.chunks_per_rank}, the chunks per rank "
                f"of the {self.name} layout"
            )
        return None

    def split_error(self, seq_len: int, what: str = "sequence length") -> str | None:
        """Why `seq_len` global tokens cannot be split, or None if they can."""
        if seq_len % self.num_chunks:
            return (
                f"{what} {seq_len} is not divisible by {self.num_chunks}: the {self.name} layout "
                f"over {self.world} CP ranks cuts it into {self.num_chunks} equal chunks; pad or "
                f"choose a length that is a multiple of {self.num_chunks}"
            )
        return None

    def check_split(self, seq_len: int, what: str = "sequence length") -> None:
        """Raise ValueError if `seq_len` cannot be split (see `split_error`)."""
        error = self.split_error(seq_len, what)
        if error:
            raise ValueError(error)

    def local_indices(self, rank: int, seq_len: int, device: torch.device | str | None = None) -> Tensor:
        """Global positions of the tokens `rank` holds, in local order."""
        self.check_split(seq_len)
        c = seq_len // self.num_chunks
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunk_ids(rank)])

    def rank_major_order(self, seq_len: int, device: torch.device | str | None = None) -> Tensor:
        """Global positions of the concatenation rank 0's tokens, rank 1's, ..."""
        return torch.cat([self.local_indices(r, seq_len, device) for r in range(self.world)])

    def shard(self, x: Tensor, dim: int, rank: int) -> Tensor:
        """This rank's part of a full-sequence tensor (a copy, chunks concatenated)."""
        self.check_split(x.shape[dim])
        c = x.shape[dim] // self.num_chunks
        return torch.cat([x.narrow(dim, i * c, c) for i in self.chunk_ids(rank)], dim=dim)

    def to_global_order(self, x: Tensor, dim: int) -> Tensor:
        """Reorder a rank-major concatenation (as all-gather returns it) into global order."""
        order = torch.argsort(self.rank_major_order(x.shape[dim], x.device))
        return self._gather_chunks(x, dim, order)

    def to_rank_major(self, x: Tensor, dim: int) -> Tensor:
        """Reorder a global-order tensor into the rank-major concatenation."""
        return self._gather_chunks(x, dim, self.rank_major_order(x.shape[dim], x.device))

    def _gather_chunks(self, x: Tensor, dim: int, order: Tensor) -> Tensor:
        # Move whole chunks, not single tokens: one narrow per chunk is far cheaper
        # than an index_select over every token.
        c = x.shape[dim] // self.num_chunks
        starts = order.view(self.num_chunks, c)[:, 0].tolist()
        return torch.cat([x.narrow(dim, s, c) for s in starts], dim=dim)
