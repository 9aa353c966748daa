"""What one CP attention call needs, decided once before any communication."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from cpcompose.attention.blocks import BlockTask, KernelArgs, MaskSpec, plan, split_work
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

    def tasks_full_sequence(self, seq_len: int) -> tuple[BlockTask, ...]:
        """Kernel calls for the whole sequence against itself, both in global order (all-to-all)."""
        return cached_plan(self.layout, self.mask, seq_len, GLOBAL, GLOBAL)


GLOBAL = -1  # "the whole sequence in global order" in place of a rank
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
