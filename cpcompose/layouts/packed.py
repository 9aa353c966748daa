"""Packed: a pack of documents split with balanced attention work (see `packed_split.py`).

A pack is one long sequence of documents; attention never crosses a document
boundary. The split is computed from `cu_seqlens` alone, so every rank builds the
same one; the layout object is then the one description of "how these shards were
cut" that sharding, positions and attention all read.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor

from cpcompose.layouts.base import Layout, Run, stable_code
from cpcompose.layouts.packed_split import Piece, split_by_documents, split_zigzag

__all__ = ["BALANCES", "Balance", "PackedLayout", "cu_seqlens_error"]

Balance = Literal["documents", "zigzag"]
BALANCES: tuple[str, ...] = ("documents", "zigzag")


def cu_seqlens_error(cu_seqlens: object) -> str | None:
    """Why `cu_seqlens` is not a valid pack description (integers from 0, increasing), or None."""
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
            return f"cu_seqlens must hold integers, got a {cu_seqlens.dtype} tensor"
        if cu_seqlens.ndim != 1:
            return f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}"
        cu = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)):
        cu = list(cu_seqlens)
    else:
        return f"cu_seqlens must be a list or a 1-D integer tensor, got {type(cu_seqlens).__name__}"
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in cu):
        return f"cu_seqlens must hold integers, got {[type(x).__name__ for x in cu[:4]]}"
    if len(cu) < 2 or cu[0] != 0:
        return f"cu_seqlens must start at 0 and hold at least one document, got {cu[:8]}"
    if any(b <= a for a, b in zip(cu, cu[1:])):
        return "cu_seqlens must be strictly increasing (every document has at least one token)"
    return None


class PackedLayout(Layout):
    """Which tokens of a pack each of `world` ranks holds; build it with `PackedLayout.build`."""

    name = "packed"

    def __init__(
        self, world: int, doc_bounds: tuple[int, ...], pieces: tuple[tuple[Piece, ...], ...], pad: int
    ) -> None:
        self.world = world
        self.doc_bounds = doc_bounds  # cu_seqlens of the padded pack
        self.pieces = pieces  # per rank, (position, length, document) in increasing position
        self.pad = pad  # tokens of padding at the end, its own document (see `pad_pack`)
        self._identity = stable_code(self.name, world, doc_bounds, pieces)

    @classmethod
    def build(
        cls,
        cu_seqlens: Sequence[int] | Tensor,
        world: int,
        *,
        balance: Balance = "documents",
        window: int | None = None,
    ) -> "PackedLayout":
        """Split a pack over `world` ranks.

        Args:
            cu_seqlens: cumulative document lengths, integers from 0 to the pack's length.
            world: CP ranks.
            balance: "documents" (zigzag within each long document, short ones whole;
                the default) or "zigzag" (plain zigzag chunks of the whole pack).
            window: the causal sliding window the attention will use, so the split
                balances windowed work. It only moves work, never results, but the
                shards must then be cut by this same layout object.

        Raises:
            ValueError: invalid `cu_seqlens`, `world`, `balance` or `window`.
        """
        error = cu_seqlens_error(cu_seqlens)
        if error is None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
            error = f"world must be a positive number of CP ranks, got {world!r}"
        if error is None and balance not in BALANCES:
            error = f"balance={balance!r} is unknown; choose one of {BALANCES}"
        bad_window = window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0)
        if error is None and bad_window:
            error = f"window must be a non-negative number of positions or None, got {window!r}"
        if error:
            raise ValueError(error)
        cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
        pad = (-cu[-1]) % (2 * world if balance == "zigzag" else world)
        bounds = tuple(cu + ([cu[-1] + pad] if pad else []))
        pieces = split_by_documents(bounds, world, window) if balance == "documents" else split_zigzag(bounds, world)
        return cls(world, bounds, pieces, pad)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackedLayout) and other.identity == self.identity

    def __hash__(self) -> int:
        return self._identity

    def __repr__(self) -> str:
        return f"PackedLayout(world={self.world}, seq_len={self.seq_len}, documents={len(self.doc_bounds) - 1})"

    @property
    def identity(self) -> int:
        return self._identity

    @property
    def keeps_global_order(self) -> bool:
        order = [p for rank in self.pieces for p, _, _ in rank]
        return order == sorted(order)

    @property
    def seq_len(self) -> int:
        """The padded pack's length, a multiple of `world`."""
        return self.doc_bounds[-1]

    def runs(self, rank: int, seq_len: int | None = None) -> list[Run]:
        runs, row = [], 0
        for pos, length, doc in self.pieces[rank]:
            runs.append(Run(row, pos, length, doc))
            row += length
        return runs

    def global_runs(self, seq_len: int | None = None) -> list[Run]:
        b = self.doc_bounds
        return [Run(b[d], b[d], b[d + 1] - b[d], d) for d in range(len(b) - 1)]

    def split_error(self, seq_len: int, what: str = "sequence length") -> str | None:
        if seq_len != self.seq_len:
            return (
                f"{what} {seq_len} does not match the packed layout's {self.seq_len} tokens (after padding; "
                "pad the pack with pad_pack first)"
            )
        return None

    def position_ids(self, rank: int, seq_len: int | None = None, device: torch.device | str | None = None) -> Tensor:
        """Positions within each token's document (restarting at 0), for RoPE."""
        b = self.doc_bounds
        return torch.cat([torch.arange(p - b[d], p - b[d] + n, device=device) for p, n, d in self.pieces[rank]])

    def local_indices(self, rank: int, seq_len: int | None = None, device: torch.device | str | None = None) -> Tensor:
        return torch.cat([torch.arange(p, p + n, device=device) for p, n, _ in self.pieces[rank]])

    def rank_major_order(self, seq_len: int | None = None, device: torch.device | str | None = None) -> Tensor:
        return torch.cat([self.local_indices(r, device=device) for r in range(self.world)])
