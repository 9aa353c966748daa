"""The block plans of a call's rank pairs, computed once and cached.

Pure functions of hashable arguments (a layout hashes by its identity): every round of
every forward and backward used to re-plan in Python. Each returns tuples, so no caller
can change what the next call reads. What every strategy's communication reads from
them: which rows another rank's plan needs (the ring's sends, the all-gather's rows).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools

from cpcompose.attention.local.blocks import BlockTask, MaskSpec, needed_rows, plan, split_work
from cpcompose.layouts import Layout

__all__ = [
    "COMPACT_GATHER_MAX_WORLD", "GLOBAL", "PLAN_CACHE_SIZE", "cached_gathered_plan", "cached_halves", "cached_plan",
    "gathered_rows", "gathered_width",
]


GLOBAL = -1  # "the whole sequence in global order" in place of a rank
COMPACT_GATHER_MAX_WORLD = 16  # above it the all-gather carries whole shards (see `gathered_rows`)
PLAN_CACHE_SIZE = 4096  # plans kept (a few MB at most): a ring call at P ranks reads 2P - 1 of them per rank


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def cached_plan(layout: Layout, mask: MaskSpec, seq_len: int, q_rank: int, kv_rank: int) -> tuple[BlockTask, ...]:
    """The block plan of `q_rank`'s queries against `kv_rank`'s keys (GLOBAL: the whole sequence).

    A pure function of hashable arguments (a layout hashes by its identity), computed
    once: every round of every forward and backward used to re-plan in Python. A
    tuple, so no caller can change what the next call reads.
    """
    def runs(rank: int) -> list:
        return layout.global_runs(seq_len) if rank == GLOBAL else layout.runs(rank, seq_len)

    return tuple(plan(runs(q_rank), runs(kv_rank), mask))


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def gathered_rows(layout: Layout, mask: MaskSpec, seq_len: int, world: int) -> tuple[tuple[slice, ...], ...]:
    """For each rank, the key rows that some *other* rank's plan reads (sorted, merged slices).

    Under a mask many rows are read by nobody else (a causal zigzag's late chunk, most of
    a packed rank's documents), and sending them is waste: the all-gather carries each
    rank's needed rows, packed in order and padded to the longest rank's (a collective
    takes equal sizes). Every rank computes the same answer from the layout alone.
    Finding them plans every pair of ranks (P^2 plans, where a rank's own calls need P):
    on a 128k-token pack of 338 documents 7 ms at P=8, 26 ms at 16, 113 ms at 32 and
    1 s at 64, paid again for every new packed layout. Above COMPACT_GATHER_MAX_WORLD
    ranks every row travels, as in Llama 3's all-gather.
    """
    if world > COMPACT_GATHER_MAX_WORLD:
        return tuple((slice(0, sum(r.length for r in layout.runs(src, seq_len))),) for src in range(world))
    return tuple(
        tuple(needed_rows(
            [t for dst in range(world) if dst != src for t in cached_plan(layout, mask, seq_len, dst, src)]
        ))
        for src in range(world)
    )


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def gathered_width(layout: Layout, mask: MaskSpec, seq_len: int, world: int) -> int:
    """Rows per rank in the all-gather: the most needed rows any rank has (every rank sends that many)."""
    return max(sum(r.stop - r.start for r in rows) for rows in gathered_rows(layout, mask, seq_len, world))


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def cached_gathered_plan(
    layout: Layout, mask: MaskSpec, seq_len: int, q_rank: int, kv_rank: int, world: int
) -> tuple[BlockTask, ...]:
    """`q_rank`'s plan on `kv_rank`'s keys, key rows renumbered into `kv_rank`'s gathered rows.

    A task reads only needed rows, and needed rows keep their order when packed, so each
    task's key range stays one contiguous range (a band's offset is relative to its own
    first key, so it does not change).
    """
    runs = gathered_rows(layout, mask, seq_len, world)[kv_rank]
    starts = [r.start for r in runs]
    packed_at, at = [], 0
    for r in runs:
        packed_at.append(at)
        at += r.stop - r.start
    renumbered = []
    for t in cached_plan(layout, mask, seq_len, q_rank, kv_rank):
        i = bisect.bisect_right(starts, t.kv.start) - 1
        assert i >= 0 and t.kv.stop <= runs[i].stop, (t, runs)  # needed_rows covers every task it was built from
        begin = packed_at[i] + t.kv.start - runs[i].start
        renumbered.append(dataclasses.replace(t, kv=slice(begin, begin + t.kv.stop - t.kv.start)))
    return tuple(renumbered)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def cached_halves(
    layout: Layout, mask: MaskSpec, seq_len: int, rank: int
) -> tuple[tuple[BlockTask, ...], tuple[BlockTask, ...]]:
    """`split_work` of `rank`'s plan against its own keys, computed once (weighing a band builds its mask)."""
    return split_work(cached_plan(layout, mask, seq_len, rank, rank))
