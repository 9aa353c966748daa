"""Layouts that cut the sequence into equal chunks and deal whole chunks to ranks."""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor

from cpcompose.layouts.base import Layout, Run, stable_code

__all__ = ["ChunkedLayout"]


class ChunkedLayout(Layout):
    """`num_chunks` equal chunks of one document (the whole sequence); `chunk_ids` says who holds which."""

    def __init__(self, world: int) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"a layout needs a positive number of CP ranks, got world={world!r}")
        self.world = world

    @property
    @abstractmethod
    def num_chunks(self) -> int:
        """How many equal chunks the sequence is cut into."""

    @abstractmethod
    def chunk_ids(self, rank: int) -> tuple[int, ...]:
        """Global chunk ids held by `rank`, increasing."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.world == self.world  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.world))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world={self.world})"

    @property
    def identity(self) -> int:
        return stable_code(self.name, self.world)

    @property
    def keeps_global_order(self) -> bool:
        return [c for r in range(self.world) for c in self.chunk_ids(r)] == list(range(self.num_chunks))

    @property
    def chunks_per_rank(self) -> int:
        return self.num_chunks // self.world

    def runs(self, rank: int, seq_len: int) -> list[Run]:
        c = seq_len // self.num_chunks
        return [Run(i * c, chunk * c, c, 0) for i, chunk in enumerate(self.chunk_ids(rank))]

    def global_runs(self, seq_len: int) -> list[Run]:
        return [Run(0, 0, seq_len, 0)]

    def split_error(self, seq_len: int, what: str = "sequence length") -> str | None:
        if seq_len < 1:
            return f"{what} {seq_len}: CP needs at least one token per chunk ({self.num_chunks} chunks)"
        if seq_len % self.num_chunks:
            return (
                f"{what} {seq_len} is not divisible by {self.num_chunks}: the {self.name} layout "
                f"over {self.world} CP ranks cuts it into {self.num_chunks} equal chunks; pad or choose a "
                f"length that is a multiple of {self.num_chunks}"
            )
        return None

    # Whole chunks move with one narrow each: far cheaper than an index_select over every token.

    def shard(self, x: Tensor, dim: int, rank: int) -> Tensor:
        self.check_split(x.shape[dim])
        c = x.shape[dim] // self.num_chunks
        return torch.cat([x.narrow(dim, i * c, c) for i in self.chunk_ids(rank)], dim=dim)

    def to_global_order(self, x: Tensor, dim: int) -> Tensor:
        owner = [(chunk, r, i) for r in range(self.world) for i, chunk in enumerate(self.chunk_ids(r))]
        slot = {chunk: r * self.chunks_per_rank + i for chunk, r, i in owner}
        return self._move_chunks(x, dim, [slot[chunk] for chunk in range(self.num_chunks)])

    def to_rank_major(self, x: Tensor, dim: int) -> Tensor:
        return self._move_chunks(x, dim, [chunk for r in range(self.world) for chunk in self.chunk_ids(r)])

    def _move_chunks(self, x: Tensor, dim: int, sources: list[int]) -> Tensor:
        c = x.shape[dim] // self.num_chunks
        return torch.cat([x.narrow(dim, s * c, c) for s in sources], dim=dim)
