"""What one CP attention call needs, decided once before any communication."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from cpcompose.attention.local.blocks import BlockTask, MaskSpec
from cpcompose.attention.local.kernels import KernelArgs
from cpcompose.attention.local.merge import SoftmaxAccumulator, fold_sinks
from cpcompose.attention.local.plans import (
    GLOBAL, cached_gathered_plan, cached_halves, cached_plan, gathered_rows, gathered_width,
)
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layouts import Layout
from cpcompose.precision import accumulator_zeros

__all__ = ["AttentionSetup", "finish_forward", "float_zeros"]


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
    sinks: Tensor | None = None  # per-head sink logits (H,), detached (`merge.fold_sinks`); None: no sinks
    head_chunks: int = 1  # "alltoall" only: chunks of heads run one after another (`alltoall_chunked.py`)
    ring_tiles: int = 1  # the ring's backward sends each round's dK/dV home in this many pieces (`ring_loop.py`)

    def head_sinks(self, heads: tuple[int, int]) -> Tensor | None:
        """The sinks of query heads `[lo, hi)` (a head-sharded strategy's own), or None."""
        return None if self.sinks is None else self.sinks[heads[0]:heads[1]]

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


def float_zeros(like: Tensor) -> Tensor:
    """An accumulator shaped like `like` (see `cpcompose.precision`)."""
    return accumulator_zeros(like.shape, like)


def finish_forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, acc: SoftmaxAccumulator, setup: AttentionSetup):
    """Fold in the sinks, cast the merged output, save what the backward needs; returns `(out, lse)`."""
    merged, lse = acc.finish()
    if setup.sinks is not None:
        merged, lse = fold_sinks(merged, lse, setup.sinks)
    out = merged.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.setup = setup
    ctx.mark_non_differentiable(lse)
    return out, lse
