"""Packed sequences (THD, `cu_seqlens`) split across a CP group with balanced work.

A pack is one long sequence of documents; attention never crosses a document
boundary. `PackedLayout` splits every long document into 2P pieces and gives rank r
pieces r and 2P-1-r (zigzag *per document*), so each rank gets an early and a late
part of it and its causal work balances; which rank takes which pair rotates to
whichever keeps the busiest rank least busy (a sliding window makes early pieces
cheap). Short documents (at most 4% of a rank's share of the attention work) stay
whole on one rank, heaviest first to the least busy rank with room: they then need no communication at all and
no extra kernel calls, and their many small costs even out the rest. No document
is padded; a short one that fits nowhere whole fills the remaining room in pieces,
so every rank holds exactly L/P tokens, as the collectives require. The pack as a
whole is padded (with its own padding "document", whose tokens see only each
other and carry no loss) to a multiple of P.

A layout is pure arithmetic on `cu_seqlens`: every rank computes the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CPGroup
from cpcompose.layout import Run

Piece = tuple[int, int, int]  # (global position, length, document)


def check_cu_seqlens(cu_seqlens: Sequence[int], seq_len: int | None = None) -> str | None:
    """Why `cu_seqlens` is not a valid pack description, or None."""
    cu = list(cu_seqlens)
    if len(cu) < 2 or cu[0] != 0:
        return f"cu_seqlens must start at 0 and hold at least one document, got {cu[:8]}"
    if any(b <= a for a, b in zip(cu, cu[1:])):
        return "cu_seqlens must be strictly increasing (every document has at least one token)"
    if seq_len is not None and cu[-1] != seq_len:
        return f"cu_seqlens must end at the sequence length {seq_len}, got {cu[-1]}"
    return None


@dataclass(frozen=True)
class PackedLayout:
    """Which tokens of a pack each of `world` ranks holds (see the module docstring)."""

    world: int
    seq_len: int  # padded length, a multiple of world
    doc_bounds: tuple[int, ...]  # cu_seqlens of the padded pack
    pieces: tuple[tuple[Piece, ...], ...]  # per rank, increasing positions
    pad: int  # tokens of padding at the end (its own document)
    name: str = "packed"

    @classmethod
    def build(
        cls,
        cu_seqlens: Sequence[int] | Tensor,
        world: int,
        *,
        balance: Literal["documents", "zigzag"] = "documents",
        window: int | None = None,
    ) -> "PackedLayout":
        """Split a pack over `world` ranks.

        Args:
            cu_seqlens: cumulative document lengths, from 0 to the pack's length.
            world: CP ranks.
            balance: "documents" (zigzag within each document, the default) or
                "zigzag" (plain zigzag chunks of the whole pack, for comparison).
            window: the sliding window the attention will use, so the split
                balances windowed causal work (it only moves work, never results).

        Raises:
            ValueError: invalid `cu_seqlens`.
        """
        cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
        error = check_cu_seqlens(cu)
        if error:
            raise ValueError(error)
        pad = (-cu[-1]) % (2 * world if balance == "zigzag" else world)
        bounds = tuple(cu + ([cu[-1] + pad] if pad else []))
        pieces = _split_by_documents(bounds, world, window) if balance == "documents" else _split_zigzag(bounds, world)
        return cls(world, bounds[-1], bounds, pieces, pad)

    # --- what the attention needs ---

    def runs(self, rank: int, seq_len: int | None = None) -> list[Run]:
        """This rank's pieces as runs over its local rows."""
        runs, row = [], 0
        for pos, length, doc in self.pieces[rank]:
            runs.append(Run(row, pos, length, doc))
            row += length
        return runs

    def global_runs(self, seq_len: int | None = None) -> list[Run]:
        """The whole pack in global order, one run per document."""
        b = self.doc_bounds
        return [Run(b[d], b[d], b[d + 1] - b[d], d) for d in range(len(b) - 1)]

    def split_error(self, seq_len: int, what: str = "sequence length") -> str | None:
        if seq_len != self.seq_len:
            return f"{what} {seq_len} does not match the packed layout's {self.seq_len} tokens (after padding)"
        return None

    def check_split(self, seq_len: int, what: str = "sequence length") -> None:
        error = self.split_error(seq_len, what)
        if error:
            raise ValueError(error)

    def local_len_error(self, local_len: int) -> str | None:
        if local_len * self.world != self.seq_len:
            return f"local length {local_len} x {self.world} ranks != the packed layout's {self.seq_len} tokens"
        return None

    # --- moving tensors ---

    def local_indices(self, rank: int, seq_len: int | None = None, device: torch.device | str | None = None) -> Tensor:
        """Global positions of this rank's tokens, in local order."""
        return torch.cat([torch.arange(p, p + n, device=device) for p, n, _ in self.pieces[rank]])

    def position_ids(self, rank: int, device: torch.device | str | None = None) -> Tensor:
        """Positions within each token's document (restarting at 0), for RoPE."""
        b = self.doc_bounds
        return torch.cat([torch.arange(p - b[d], p - b[d] + n, device=device) for p, n, d in self.pieces[rank]])

    def local_cu_seqlens(self, rank: int) -> Tensor:
        """Boundaries of the local document pieces (what a varlen kernel takes), int32."""
        lengths = [n for _, n, _ in self.pieces[rank]]
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def rank_major_order(self, seq_len: int | None = None, device: torch.device | str | None = None) -> Tensor:
        return torch.cat([self.local_indices(r, device=device) for r in range(self.world)])

    def shard(self, x: Tensor, dim: int, rank: int) -> Tensor:
        """This rank's tokens of a full (padded) pack."""
        self.check_split(x.shape[dim])
        return x.index_select(dim, self.local_indices(rank, device=x.device))

    def to_global_order(self, x: Tensor, dim: int) -> Tensor:
        order = torch.argsort(self.rank_major_order(device=x.device))
        return x.index_select(dim, order)

    def to_rank_major(self, x: Tensor, dim: int) -> Tensor:
        return x.index_select(dim, self.rank_major_order(device=x.device))


def _prefix_cost(t: int, window: int | None) -> int:
    """Causal attention pairs of a document's first `t` tokens (each sees min(pos, window) + 1 keys)."""
    w = t if window is None else min(t, window + 1)
    return w * (w + 1) // 2 + (t - w) * (w if window is None else window + 1)


WHOLE_SHARE = 0.04  # a document whose work is at most this share of a rank's stays whole


def _split_by_documents(bounds: Sequence[int], world: int, window: int | None) -> tuple[tuple[Piece, ...], ...]:
    """Long documents zigzag-split over every rank; short ones placed whole, heaviest first."""
    capacity = bounds[-1] // world
    pieces: list[list[Piece]] = [[] for _ in range(world)]
    held, work = [0] * world, [0] * world

    def put(rank: int, pos: int, size: int, doc: int, start: int) -> None:
        pieces[rank].append((pos, size, doc))
        held[rank] += size
        work[rank] += _prefix_cost(pos + size - start, window) - _prefix_cost(pos - start, window)

    docs = list(enumerate(zip(bounds, bounds[1:])))
    per_rank = sum(_prefix_cost(b - a, window) for _, (a, b) in docs) / world
    short = [(d, a, b) for d, (a, b) in docs if _prefix_cost(b - a, window) <= WHOLE_SHARE * per_rank]
    whole = {d for d, _, _ in short}
    for doc, (start, stop) in docs:
        n = stop - start
        if doc in whole:
            continue
        base, extra = divmod(n, 2 * world)
        # Which rank takes pair i (pieces i and 2P-1-i): the rotation that keeps the busiest
        # rank least busy (with a window, early pieces are cheaper).
        edges = [i * base for i in range(2 * world + 1)]
        cost = [_prefix_cost(edges[i + 1], window) - _prefix_cost(edges[i], window) for i in range(2 * world)]
        pair = [cost[i] + cost[2 * world - 1 - i] for i in range(world)]
        rot = min(range(world), key=lambda r: (max(work[(i + r) % world] + pair[i] for i in range(world)), r))
        owner_of_pair = [(i + rot) % world for i in range(world)]
        sizes = [base] * (2 * world)
        order = sorted(range(world), key=lambda r: (held[r], r))  # extra tokens to the emptiest ranks
        pair_of_owner = {o: i for i, o in enumerate(owner_of_pair)}
        for j in range(extra):
            i = pair_of_owner[order[j % world]]
            sizes[i if j < world else 2 * world - 1 - i] += 1
        pos = start
        for i, size in enumerate(sizes):
            put(owner_of_pair[i if i < world else 2 * world - 1 - i], pos, size, doc, start)
            pos += size
    # Short documents whole, heaviest first, each to the least busy rank with room (longest-
    # processing-time scheduling); one that fits nowhere fills the remaining room in pieces.
    for doc, start, stop in sorted(short, key=lambda t: (-_prefix_cost(t[2] - t[1], window), t[1])):
        n = stop - start
        fits = [r for r in range(world) if capacity - held[r] >= n]
        if fits:
            put(min(fits, key=lambda r: (work[r], held[r], r)), start, n, doc, start)
            continue
        pos = start
        for r in sorted(range(world), key=lambda r: (work[r], r)):
            size = min(capacity - held[r], stop - pos)
            if size > 0:
                put(r, pos, size, doc, start)
                pos += size
    return tuple(tuple(sorted(p for p in rank_pieces if p[1])) for rank_pieces in pieces)


def _split_zigzag(bounds: Sequence[int], world: int) -> tuple[tuple[Piece, ...], ...]:
    """Plain zigzag chunks of the whole pack, cut where documents end."""
    c = bounds[-1] // (2 * world)
    pieces: list[list[Piece]] = [[] for _ in range(world)]
    for chunk in range(2 * world):
        owner = chunk if chunk < world else 2 * world - 1 - chunk
        lo, hi = chunk * c, (chunk + 1) * c
        for doc, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                pieces[owner].append((a, b - a, doc))
    return tuple(tuple(sorted(p)) for p in pieces)


@dataclass(frozen=True)
class PackedShard:
    """This rank's view of a packed sequence: what to feed the model and the attention."""

    layout: PackedLayout
    indices: Tensor  # global positions of the local tokens (index the padded pack with them)
    position_ids: Tensor  # positions within each document, for RoPE
    cu_seqlens: Tensor  # boundaries of the local document pieces


def cp_shard_packed(
    cu_seqlens: Sequence[int] | Tensor,
    mesh: DeviceMesh,
    *,
    balance: Literal["documents", "zigzag"] = "documents",
    window: int | None = None,
) -> PackedShard:
    """Split a pack across the CP mesh with balanced attention work.

    Gather this rank's tokens with `tensor.index_select(seq_dim, shard.indices)`
    (pad the pack by `shard.layout.pad` tokens first, e.g. with
    `pad_pack`), feed `shard.position_ids` to RoPE, and pass `layout=shard.layout`
    to `cp_attention` (or the CP style / context manager).

    Raises:
        ValueError: `cu_seqlens` does not start at 0 or is not increasing.
    """
    cp = CPGroup.from_mesh(mesh)
    layout = PackedLayout.build(cu_seqlens, cp.world, balance=balance, window=window)
    return PackedShard(
        layout, layout.local_indices(cp.rank), layout.position_ids(cp.rank), layout.local_cu_seqlens(cp.rank)
    )


def pad_pack(x: Tensor, layout: PackedLayout, *, dim: int, value: float | int = 0) -> Tensor:
    """Append the layout's padding tokens to a full pack along `dim`."""
    if not layout.pad:
        return x
    shape = list(x.shape)
    shape[dim] = layout.pad
    return torch.cat([x, x.new_full(shape, value)], dim=dim)
