"""What one CP attention call needs, decided once before any communication."""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from cpcompose.attention.blocks import BlockTask, MaskSpec, needed_rows, plan, split_work
from cpcompose.attention.kernels import KernelArgs
from cpcompose.attention.merge import SoftmaxAccumulator
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layouts import Layout
from cpcompose.precision import accumulator_zeros


@dataclass(frozen=True)
class AttentionSetup:
    """The group, layout, mask and kernel of one CP attention call."""

    cp: CPGroup
    layout: Layout
    mask: MaskSpec
    kernel: KernelArgs
    meter: CommMeter | None = None
    need_lse: bool = True  # the caller wants the LSE back (all-to-all must then send it home)
    alltoall_size: int | None = None  # ranks per all-to-all block ("alltoall_ring" only)
    strategy: str = "ring"  # the strategy that runs (what "auto" chose, for an "auto" call)

    def seq_len(self, local_seq: int) -> int:
        return local_seq * self.cp.world

    def tasks_between(self, q_rank: int, kv_rank: int, local_seq: int) -> tuple[BlockTask, ...]:
        """Kernel calls for rank `q_rank`'s queries against rank `kv_rank`'s keys."""
        return cached_plan(self.layout, self.mask, self.seq_len(local_seq), q_rank, kv_rank)

    def local_halves(self, rank: int, local_seq: int) -> tuple[tuple[BlockTask, ...], tuple[BlockTask, ...]]:
        """`rank`'s kernel calls on its own keys, as two parts of about equal work (`split_work`)."""
        return cached_halves(self.layout, self.mask, self.seq_len(local_seq), rank)

    def gathered_rows(self, local_seq: int) -> tuple[tuple[slice, ...], ...]:
        """Per rank, the key rows some other rank reads: what the all-gather carries (`gathered_rows`)."""
        return gathered_rows(self.layout, self.mask, self.seq_len(local_seq), self.cp.world)

    def gathered_width(self, local_seq: int) -> int:
        """Rows each rank sends in the all-gather (`gathered_width`)."""
        return gathered_width(self.layout, self.mask, self.seq_len(local_seq), self.cp.world)

    def tasks_on_gathered(self, q_rank: int, kv_rank: int, local_seq: int) -> tuple[BlockTask, ...]:
        """`tasks_between`, with `kv_rank`'s key rows numbered as they arrive in the all-gather."""
        return cached_gathered_plan(self.layout, self.mask, self.seq_len(local_seq), q_rank, kv_rank, self.cp.world)

    def tasks_full_sequence(self, seq_len: int) -> tuple[BlockTask, ...]:
        """Kernel calls for the whole sequence against itself, both in global order (all-to-all)."""
        return cached_plan(self.layout, self.mask, seq_len, GLOBAL, GLOBAL)


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
        tuple(needed_rows([t for dst in range(world) if dst != src for t in cached_plan(layout, mask, seq_len, dst, src)]))
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


def float_zeros(like: Tensor) -> Tensor:
    """An accumulator shaped like `like` (see `cpcompose.precision`)."""
    return accumulator_zeros(like.shape, like)


def finish_forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, acc: SoftmaxAccumulator, setup: AttentionSetup):
    """Cast the merged output, save what the backward needs; returns `(out, lse)`."""
    merged, lse = acc.finish()
    out = merged.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.setup = setup
    ctx.mark_non_differentiable(lse)
    return out, lse
