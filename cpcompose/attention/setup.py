"""What one CP attention call needs, decided once before any communication."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.blocks import BlockTask, KernelArgs, MaskSpec, plan
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

    def seq_len(self, local_seq: int) -> int:
        return local_seq * self.cp.world

    def tasks_between(self, q_rank: int, kv_rank: int, local_seq: int) -> list[BlockTask]:
        """Kernel calls for rank `q_rank`'s queries against rank `kv_rank`'s keys."""
        seq = self.seq_len(local_seq)
        return plan(self.layout.runs(q_rank, seq), self.layout.runs(kv_rank, seq), self.mask)

    def tasks_against_all(self, local_seq: int) -> list[BlockTask]:
        """Kernel calls for the local queries against the whole sequence in global order."""
        seq = self.seq_len(local_seq)
        return plan(self.layout.runs(self.cp.rank, seq), self.layout.global_runs(seq), self.mask)

    def tasks_full_sequence(self, seq_len: int) -> list[BlockTask]:
        """Kernel calls for the whole sequence against itself, both in global order (all-to-all)."""
        runs = self.layout.global_runs(seq_len)
        return plan(runs, runs, self.mask)


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
