"""Zigzag: 2P chunks, rank r holds chunks r and 2P-1-r (an early and a late one).

Under a causal mask every rank then does the same attention work, which is why
it is the default. Bidirectional attention is exact under it too.
"""

from __future__ import annotations

from cpcompose.layouts.chunked import ChunkedLayout

__all__ = ["ZigzagLayout"]


class ZigzagLayout(ChunkedLayout):
    name = "zigzag"

    @property
    def num_chunks(self) -> int:
        return 2 * self.world

    def chunk_ids(self, rank: int) -> tuple[int, ...]:
        return (rank, 2 * self.world - 1 - rank)
