"""Ring attention: K/V move point-to-point, one peer distance per round, overlapped.

Round 0 attends to the local K/V. In round s = 1..P-1 every rank sends to rank+s,
and receives from rank-s, exactly the K/V rows the receiver's block plan reads,
posted one round ahead so the transfer runs while the previous round computes.
For full attention that is the whole shard, so the volume equals the classic ring
rotation (P-1 shards). Under masks it is less: with a causal zigzag layout a rank
earlier in the order needs only the early chunk; with documents only the pieces of
shared documents; with a sliding window only the rows within the window (a halo,
not a rotation; a two-sided window gives a halo on both sides). Rows nobody
needs are never sent, and rounds with nothing to attend are skipped.

Backward repeats the exchange of K/V and sends each block's dK/dV (float32, so
bf16 rounding does not grow with P) straight back to the rank that owns those
rows. dQ stays local.

The loop itself (`ring_loop.py`) is shared with the 2-D strategy, which runs it across
its all-to-all blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.local.call_setup import AttentionSetup, finish_forward
from cpcompose.attention.cost.model import RING_FAMILY
from cpcompose.attention.local.merge import SoftmaxAccumulator
from cpcompose.attention.strategies.ring_loop import RingView, Rounds, ring_backward, ring_forward
from cpcompose.attention.strategies.strategy import Strategy
from cpcompose.comm import RingComm

__all__ = ["RING", "RingAttention"]


def _rounds(setup: AttentionSetup, local_seq: int) -> Rounds:
    return Rounds(setup.layout, setup.mask, RingView(setup.cp.rank, setup.cp.world), local_seq)


class RingAttention(torch.autograd.Function):
    """`(q, k, v) -> (out, lse)` on local shards; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
        k, v = k.contiguous(), v.contiguous()
        acc = SoftmaxAccumulator(q, v.shape[-1])
        ring_forward(acc, q, k, v, _rounds(setup, q.shape[2]), RingComm(setup.cp, setup.meter), setup.kernel)
        return finish_forward(ctx, q, k, v, acc, setup)

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        setup: AttentionSetup = ctx.setup
        dq, dk, dv = ring_backward(
            dout.contiguous(), q, k, v, out, lse, _rounds(setup, q.shape[2]), RingComm(setup.cp, setup.meter),
            setup.kernel, pieces=setup.ring_tiles,
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


RING = Strategy(
    "ring", RingAttention, saves="inputs", block_size=lambda world, alltoall_size: 1, cost=RING_FAMILY,
)
"""K/V point-to-point round the whole CP group (the all-to-all family with blocks of one rank)."""
