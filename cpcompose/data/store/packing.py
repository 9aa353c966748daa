"""Best-fit-decreasing packing of documents into rows ("Fewer Truncations Improve Language Modeling").

Only a document longer than a row is cut (into row-length pieces and a remainder); every other document lands
whole in the row whose free space it fills most tightly, the longest first, so rows are nearly full and no
short document is ever split.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

__all__ = ["best_fit_rows", "pieces_of"]


def pieces_of(lengths: np.ndarray, capacity: int, repeats: np.ndarray | None = None) -> np.ndarray:
    """The pieces to pack, int64 ``[P, 3]`` rows of (document, start, length): each document whole when it fits
    in ``capacity``, else cut at every ``capacity`` tokens; document ``d`` repeated ``repeats[d]`` times (0 drops
    it). Documents of length 0 give no piece."""
    lengths = np.asarray(lengths, dtype=np.int64)
    reps = np.ones_like(lengths) if repeats is None else np.asarray(repeats, dtype=np.int64)
    cuts = np.where(lengths > 0, -(-lengths // capacity), 0) * reps  # pieces per document, repeats included
    docs = np.repeat(np.arange(lengths.size, dtype=np.int64), cuts)
    first = np.cumsum(cuts) - cuts  # index of each document's first piece
    within = np.arange(docs.size, dtype=np.int64) - np.repeat(first, cuts)
    per_copy = np.repeat(np.where(lengths > 0, -(-lengths // capacity), 1), cuts)
    start = (within % per_copy) * capacity
    return np.stack([docs, start, np.minimum(capacity, lengths[docs] - start)], axis=1)


def best_fit_rows(pieces: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``pieces`` (``[P, 3]``, each length at most ``capacity``) into rows by best fit, longest first.

    Returns:
        ``(order, row_starts)``: the pieces reordered row by row (``[P, 3]``) and int64 ``[R + 1]`` offsets of
        each row's first piece in it, then ``P``.
    """
    lengths = pieces[:, 2]
    order = np.argsort(-lengths, kind="stable")  # decreasing, ties in document order (deterministic)
    free_values: list[int] = []  # sorted distinct amounts of free space that some open row has
    rows_with: dict[int, list[int]] = {}  # free space -> open rows with it (the last opened is used first)
    row_of = np.empty(len(order), dtype=np.int64)
    rows = 0
    for i, length in zip(order.tolist(), lengths[order].tolist()):
        at = bisect_left(free_values, length)
        if at < len(free_values):  # the tightest open row that holds it
            free = free_values[at]
            bucket = rows_with[free]
            row = bucket.pop()
            if not bucket:
                del rows_with[free], free_values[at]
        else:
            row, free = rows, capacity
            rows += 1
        row_of[i] = row
        left = free - length
        if left > 0:
            if left not in rows_with:
                rows_with[left] = []
                insort(free_values, left)
            rows_with[left].append(row)
    by_row = np.argsort(row_of, kind="stable")
    row_starts = np.searchsorted(row_of[by_row], np.arange(rows + 1, dtype=np.int64))
    return pieces[by_row], row_starts.astype(np.int64)
