"""The packed split: long documents zigzag-split over every rank, short ones whole.

Every long document is cut into 2P pieces and rank r gets pieces r and 2P-1-r
(zigzag *per document*), so each rank gets an early and a late part of it and its
causal work balances; which rank takes which pair rotates to whichever keeps the
busiest rank least busy (a sliding window makes early pieces cheap). Short
documents (at most 4% of a rank's share of the attention work) stay whole on one
rank, heaviest first to the least busy rank with room: they then need no
communication and no extra kernel calls, and their many small costs even out the
rest. No document is padded; a short one that fits nowhere whole fills the
remaining room in pieces, so every rank holds exactly L/P tokens, as the
collectives require. Pure arithmetic on the document bounds.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["WHOLE_SHARE", "Piece", "split_by_documents", "split_zigzag"]

Piece = tuple[int, int, int]  # (global position, length, document)


def _prefix_cost(t: int, window: int | None) -> int:
    """Causal attention pairs of a document's first `t` tokens (each sees min(pos, window) + 1 keys)."""
    w = t if window is None else min(t, window + 1)
    return w * (w + 1) // 2 + (t - w) * (w if window is None else window + 1)


WHOLE_SHARE = 0.04  # a document whose work is at most this share of a rank's stays whole


def split_by_documents(bounds: Sequence[int], world: int, window: int | None) -> tuple[tuple[Piece, ...], ...]:
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


def split_zigzag(bounds: Sequence[int], world: int) -> tuple[tuple[Piece, ...], ...]:
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
