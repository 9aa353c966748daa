"""What one CP attention call needs, decided once before any communication."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cpcompose.attention.blocks import BlockTask, KernelArgs, plan_blocks
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layout import SeqLayout


@dataclass(frozen=True)
class AttentionSetup:
    """The group, layout, mask and kernel of one CP attention call."""

    cp: CPGroup
    layout: SeqLayout
    causal: bool
    kernel: KernelArgs
    meter: CommMeter | None = None
    need_lse: bool = True  # the caller wants the LSE back (all-to-all must then send it home)

    def chunk_len(self, local_seq: int) -> int:
        return local_seq // self.layout.chunks_per_rank

    def tasks_against_rank(self, src: int, local_seq: int) -> list[BlockTask]:
        """Kernel calls for the local queries against rank `src`'s keys."""
        return plan_blocks(
            self.layout.chunk_ids(self.cp.rank), self.layout.chunk_ids(src),
            self.chunk_len(local_seq), causal=self.causal,
        )

    def tasks_against_all(self, local_seq: int) -> list[BlockTask]:
        """Kernel calls for the local queries against the whole sequence in global order."""
        return plan_blocks(
            self.layout.chunk_ids(self.cp.rank), range(self.layout.num_chunks),
            self.chunk_len(local_seq), causal=self.causal,
        )


def float_zeros(like: Tensor) -> Tensor:
    """A float32 (float64 for float64) accumulator shaped like `like`."""
    return torch.zeros(like.shape, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)
