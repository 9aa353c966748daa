"""Bytes of indexer-selected attention under CP: fetching the selected rows, or gathering them all.

The one owner of these volumes (the strategy's choice and `scripts/benchmarks/bench_sparse.py`
read them from here); each count mirrors `cpcompose.attention.sparse.selected_rows`:

* selected rows: forward, each rank shares its count of rows wanted from each rank
  (an all-gather of `P` int64), sends its row requests (int64 ids) to their owners
  and the rows others requested from it; backward, it returns the gradients of the
  rows it fetched, one per row. `fetch[r][s]` rows go from s to r.
* all rows (the all-gather's traffic): the same with every row another rank owns
  fetched, and no requests (the plan is known from the layout).

A row is `row_values` values (K and V of every K/V head) of `itemsize` bytes. The
choice compares the busiest rank's bytes, as a step waits for the slowest rank.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ALLGATHER", "SELECTED", "allgather_sent", "choose", "selected_sent"]

SELECTED = "selected"
ALLGATHER = "allgather"
_ID_BYTES = 8  # an int64 row id


def selected_sent(fetch: Sequence[Sequence[int]], rank: int, row_values: int, itemsize: int) -> int:
    """Bytes `rank` sends in one forward and backward of the selected-rows exchange."""
    world = len(fetch)
    requests = sum(fetch[rank]) - fetch[rank][rank]
    served = sum(row[rank] for r, row in enumerate(fetch) if r != rank)
    return ((world - 1) * world + requests) * _ID_BYTES + (served + requests) * row_values * itemsize


def allgather_sent(batch: int, local_len: int, world: int, row_values: int, itemsize: int) -> int:
    """Bytes one rank sends when every rank fetches every row it does not hold (forward and backward)."""
    rows = batch * local_len * (world - 1)
    return 2 * rows * row_values * itemsize


def choose(fetch: Sequence[Sequence[int]], batch: int, local_len: int, row_values: int, itemsize: int) -> str:
    """`SELECTED` when its busiest rank sends fewer bytes than the all-gather's, else `ALLGATHER`.

    A function of the count table every rank holds, so every rank chooses alike.
    """
    world = len(fetch)
    sparse = max(selected_sent(fetch, r, row_values, itemsize) for r in range(world))
    dense = allgather_sent(batch, local_len, world, row_values, itemsize)
    return SELECTED if sparse < dense else ALLGATHER
