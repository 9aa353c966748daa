"""All-to-all attention (Ulysses): trade sequence shards for head shards and back.

One all-to-all gives every rank the whole sequence for a subset of the heads; it
attends locally with the full-sequence kernel, and a second all-to-all returns
the output to sequence shards. Works for any query and K/V head counts, with GQA K/V never
expanded before the exchange (`heads.py`, shared with the 2-D strategy; the steps: `alltoall_steps.py`).
With `head_chunks` > 1 the call runs a chunk of heads at a time instead (`alltoall_chunked.py`, UPipe): the
same math, buffers sized by the chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.local.call_setup import AttentionSetup
from cpcompose.attention.cost.model import RING_FAMILY
from cpcompose.attention.local.heads import HeadPlan, gather_grads, head_plan
from cpcompose.attention.strategies.alltoall_chunked import ChunkedAllToAllAttention
from cpcompose.attention.strategies.alltoall_steps import (
    attend_heads, attend_heads_backward, to_head_shards, to_seq_shards,
)
from cpcompose.attention.strategies.strategy import Strategy

__all__ = ["ALLTOALL", "AllToAllAttention"]


class AllToAllAttention(torch.autograd.Function):
    """`(q, k, v) -> (out, lse)` on local shards; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
        if setup.head_chunks > 1:  # UPipe: a chunk of heads at a time, saving only the local shards
            return ChunkedAllToAllAttention.forward(ctx, q, k, v, setup)
        plan = head_plan(q.shape[1], k.shape[1], setup.cp.world, setup.cp.rank, q.device)
        ranges = [plan.q_ranges, plan.kv_ranges, plan.kv_ranges]
        qh, kh, vh = to_head_shards([q, k, v], ranges, setup)
        sinks = setup.head_sinks(plan.q_ranges[setup.cp.rank])
        out_h, lse_h = attend_heads(qh, plan.local_kv(kh), plan.local_kv(vh), setup, sinks)
        (out_parts,) = zip(*to_seq_shards([out_h], [plan.q_ranges], setup))
        if setup.need_lse:
            (lse_parts,) = zip(*to_seq_shards([lse_h.unsqueeze(-1)], [plan.q_ranges], setup))
            lse = torch.cat(lse_parts, dim=1).squeeze(-1)
        else:  # nobody asked: spare the exchange
            lse = lse_h.new_empty(0)
        ctx.save_for_backward(qh, kh, vh, out_h, lse_h)
        ctx.setup, ctx.plan, ctx.n_kv = setup, plan, k.shape[1]
        ctx.mark_non_differentiable(lse)
        return torch.cat(out_parts, dim=1), lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
        if ctx.setup.head_chunks > 1:
            return ChunkedAllToAllAttention.backward(ctx, dout, _dlse)
        qh, kh, vh, out_h, lse_h = ctx.saved_tensors
        setup: AttentionSetup = ctx.setup
        plan: HeadPlan = ctx.plan
        (dout_h,) = to_head_shards([dout.contiguous()], [plan.q_ranges], setup)
        dq_h, dk_h, dv_h = attend_heads_backward(
            dout_h, qh, plan.local_kv(kh), plan.local_kv(vh), out_h, lse_h, setup
        )
        dk_h, dv_h = plan.reduce_local_kv(dk_h, kh.shape[1]), plan.reduce_local_kv(dv_h, vh.shape[1])
        ranges = [plan.q_ranges, plan.kv_ranges, plan.kv_ranges]
        dq, dk, dv = gather_grads(to_seq_shards([dq_h, dk_h, dv_h], ranges, setup), plan.kv_ranges, ctx.n_kv)
        return dq, dk, dv, None


ALLTOALL = Strategy(
    "alltoall", AllToAllAttention, saves="head_shards", block_size=lambda world, alltoall_size: world,
    cost=RING_FAMILY, whole_sequence_call=True,
)
"""Ulysses over the whole CP group (the all-to-all family with one block of every rank)."""
