"""Ring attention: K/V travel point-to-point around the CP group.

Forward: P steps; at step s this rank holds the K/V of rank (rank - s) mod P,
posts the send of that block to the next rank before computing on it, and merges
the partial result through the LSE. Each rank sends P-1 K/V shards, with their
own (possibly GQA-reduced) head count.

Backward: the same rotation of K/V, plus a float32 dK/dV sum that travels with its
K/V block: it starts at rank o+1 (rank o keeps its own contribution), every rank
holding block o adds its part and passes it on, and after P-1 hops it arrives back
at rank o. dQ stays local. The sum is float32 so bf16 rounding does not grow with
the ring size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.blocks import backward_blocks, forward_blocks
from cpcompose.attention.merge import SoftmaxAccumulator
from cpcompose.attention.setup import AttentionSetup, float_zeros
from cpcompose.comm import PendingRecv, RingComm

_KV_TAG, _GRAD_TAG = 0, 1


class RingAttention(torch.autograd.Function):
    """`(q, k, v) -> (out, lse)` on local shards; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
        ring, seq = RingComm(setup.cp, setup.meter), q.shape[2]
        k, v = k.contiguous(), v.contiguous()
        acc = SoftmaxAccumulator(q, v.shape[-1])
        kv = [k, v]
        for step in range(setup.cp.world):
            pending = ring.exchange(kv, tag=_KV_TAG) if step + 1 < setup.cp.world else None
            src = (setup.cp.rank - step) % setup.cp.world
            forward_blocks(acc, q, kv[0], kv[1], setup.tasks_against_rank(src, seq), setup.kernel)
            if pending is not None:
                kv = pending.wait()
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.setup = setup
        ctx.mark_non_differentiable(acc.lse)
        return out, acc.lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        setup: AttentionSetup = ctx.setup
        ring, seq, world = RingComm(setup.cp, setup.meter), q.shape[2], setup.cp.world
        dout = dout.contiguous()
        dq = float_zeros(q)
        kv = [k, v]
        own: list[Tensor] = []  # this rank's contribution to its own dK/dV, kept local
        in_flight: PendingRecv | None = None  # the travelling sum for the block arriving next
        for step in range(world):
            pending_kv = ring.exchange(kv, tag=_KV_TAG) if step + 1 < world else None
            src = (setup.cp.rank - step) % world
            dkv = [float_zeros(k), float_zeros(v)]
            tasks = setup.tasks_against_rank(src, seq)
            backward_blocks((dq, dkv[0], dkv[1]), dout, q, kv[0], kv[1], out, lse, tasks, setup.kernel)
            if step == 0:
                own = dkv
            else:
                if in_flight is not None:
                    for acc, arrived in zip(dkv, in_flight.wait()):
                        acc += arrived
                # At the last step the next rank is the block's owner: the sum goes home.
                in_flight = ring.exchange(dkv, tag=_GRAD_TAG)
            if pending_kv is not None:
                kv = pending_kv.wait()
        dk, dv = own
        if in_flight is not None:
            arrived_k, arrived_v = in_flight.wait()
            dk, dv = dk + arrived_k, dv + arrived_v
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
