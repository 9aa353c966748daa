"""A CP attention strategy is one record: its name, its autograd function, what it saves, its cost model.

Everything that must know a strategy asks its record (`registry.STRATEGIES`): the call
path runs `function`, the compiled op shapes its saved tensors by `saves`, the options
check `alltoall_size` by `takes_alltoall_size`, and the cost model predicts it from
`cost` (its family's traffic, time and memory) and `block_size`. A new strategy is one
file (the function and its record) plus one line in `registry.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from cpcompose.attention.local.call_setup import AttentionSetup
from cpcompose.attention.cost.model import CostModel

__all__ = ["Saves", "Strategy"]

Saves = Literal["inputs", "head_shards"]


def _no_size(world: int) -> list[int | None]:
    return [None]


@dataclass(frozen=True)
class Strategy:
    """One CP attention strategy.

    Attributes:
        name: the `CPOptions.strategy` that selects it.
        function: a `torch.autograd.Function` whose `apply(q, k, v, setup)` returns `(out, lse)`
            and whose `forward(ctx, q, k, v, setup)` / `backward(ctx, dout, dlse)` the
            compiled op drives directly.
        saves: what its forward saves for backward: "inputs" (q, k, v, out, lse: the
            compiled op's backward gets them anyway) or "head_shards" (q, k, v, out, lse
            of its heads over a block of `block_size` ranks: they travel as the op's residuals).
        block_size: `(world, alltoall_size) -> a`, the ranks of one all-to-all block (1
            for the ring, the world for all-to-all); raises ValueError on a size it cannot use.
        cost: its family's traffic, time and memory model (`cost.model.RING_FAMILY`, `GATHER`).
        takes_alltoall_size: it needs `alltoall_size` (and no other strategy takes one).
        whole_sequence_call: it attends the whole sequence of its heads in one kernel call
            where the plan allows (all-to-all); the cost model reads the same rule.
        candidate_sizes: `world -> [alltoall_size, ...]` that `strategy="auto"` weighs.
    """

    name: str
    function: type[torch.autograd.Function]
    saves: Saves
    block_size: Callable[[int, int | None], int]
    cost: CostModel
    takes_alltoall_size: bool = False
    whole_sequence_call: bool = False
    candidate_sizes: Callable[[int], list[int | None]] = field(default=_no_size)

    def apply(self, q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
        """`(out, lse)` of the local shards (differentiable in q, k, v)."""
        return self.function.apply(q, k, v, setup)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"Strategy({self.name!r})"
