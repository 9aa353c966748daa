"""All-to-all attention (Ulysses): trade sequence shards for head shards and back.

One all-to-all gives every rank the whole sequence for a subset of the heads; it
attends locally with the full-sequence kernel, and a second all-to-all returns
the output to sequence shards. Works for any query and K/V head counts and K/V head counts, with GQA K/V never
expanded before the exchange (`heads.py`, shared with the 2-D strategy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.local.blocks import one_kernel_call
from cpcompose.attention.local.call_setup import AttentionSetup, float_zeros
from cpcompose.attention.cost.model import RING_FAMILY
from cpcompose.attention.local.execute import backward_blocks, forward_blocks
from cpcompose.attention.local.heads import (
    HeadGroup, HeadPlan, HeadRange, gather_grads, head_plan, heads_to_seq, seq_to_heads,
)
from cpcompose.attention.local.kernels import attention_backward, attention_forward
from cpcompose.attention.local.merge import SoftmaxAccumulator, fold_sinks, keep_nan_rows
from cpcompose.attention.strategies.strategy import Strategy

__all__ = ["ALLTOALL", "AllToAllAttention"]


def _seq_to_heads(tensors: list[Tensor], ranges: list[list[HeadRange]], setup: AttentionSetup) -> list[Tensor]:
    """Sequence shards `(B, H_i, S, D)` -> head shards `(B, n_i, L, D)` in global order."""
    group = HeadGroup(0, setup.cp.world, setup.cp.rank)
    heads = seq_to_heads(tensors, ranges, setup.cp, setup.meter, group)
    return [setup.layout.to_global_order(t, dim=2) for t in heads]


def _heads_to_seq(tensors: list[Tensor], ranges: list[list[HeadRange]], setup: AttentionSetup) -> list[list[Tensor]]:
    """Head shards in global order -> per source rank, its `(B, n_src, S, D)` piece of our tokens."""
    group = HeadGroup(0, setup.cp.world, setup.cp.rank)
    rank_major = [setup.layout.to_rank_major(t, dim=2) for t in tensors]
    return heads_to_seq(rank_major, ranges, setup.cp, setup.meter, group)


def _attend(q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """Full-sequence attention of this rank's heads (global order), masked by the layout's documents, with
    their `sinks` folded in."""
    if q.shape[1] == 0:  # more ranks than query heads: this rank has nothing to attend
        return q.new_empty((*q.shape[:3], v.shape[-1])), q.new_empty(q.shape[:3], dtype=float_zeros(q).dtype)
    tasks = setup.tasks_full_sequence(q.shape[2])
    if one_kernel_call(tasks, q.shape[2]):
        out, lse = attention_forward(
            q, k, v, causal=tasks[0].kind == "causal", scale=setup.kernel.scale, backend=setup.kernel.backend,
            softcap=setup.kernel.softcap,
        )
        keep_nan_rows(q, out, lse)
        if sinks is not None:
            merged, lse = fold_sinks(out.to(lse.dtype), lse, sinks)
            out = merged.to(q.dtype)
        return out, lse
    acc = SoftmaxAccumulator(q, v.shape[-1])
    forward_blocks(acc, q, k, v, tasks, setup.kernel)
    out, lse = acc.finish()
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def _attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, setup: AttentionSetup
) -> tuple[Tensor, Tensor, Tensor]:
    if q.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    tasks = setup.tasks_full_sequence(q.shape[2])
    if one_kernel_call(tasks, q.shape[2]):
        return attention_backward(
            dout, q, k, v, out, lse, causal=tasks[0].kind == "causal", scale=setup.kernel.scale,
            backend=setup.kernel.backend, softcap=setup.kernel.softcap,
        )
    grads = (float_zeros(q), float_zeros(k), float_zeros(v))
    backward_blocks(grads, dout, q, k, v, out, lse, tasks, setup.kernel)
    return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)


class AllToAllAttention(torch.autograd.Function):
    """`(q, k, v) -> (out, lse)` on local shards; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
        plan = head_plan(q.shape[1], k.shape[1], setup.cp.world, setup.cp.rank, q.device)
        ranges = [plan.q_ranges, plan.kv_ranges, plan.kv_ranges]
        qh, kh, vh = _seq_to_heads([q, k, v], ranges, setup)
        sinks = setup.head_sinks(plan.q_ranges[setup.cp.rank])
        out_h, lse_h = _attend(qh, plan.local_kv(kh), plan.local_kv(vh), setup, sinks)
        (out_parts,) = zip(*_heads_to_seq([out_h], [plan.q_ranges], setup))
        if setup.need_lse:
            (lse_parts,) = zip(*_heads_to_seq([lse_h.unsqueeze(-1)], [plan.q_ranges], setup))
            lse = torch.cat(lse_parts, dim=1).squeeze(-1)
        else:  # nobody asked: spare the exchange
            lse = lse_h.new_empty(0)
        ctx.save_for_backward(qh, kh, vh, out_h, lse_h)
        ctx.setup, ctx.plan, ctx.n_kv = setup, plan, k.shape[1]
        ctx.mark_non_differentiable(lse)
        return torch.cat(out_parts, dim=1), lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
        qh, kh, vh, out_h, lse_h = ctx.saved_tensors
        setup: AttentionSetup = ctx.setup
        plan: HeadPlan = ctx.plan
        (dout_h,) = _seq_to_heads([dout.contiguous()], [plan.q_ranges], setup)
        dq_h, dk_h, dv_h = _attend_backward(dout_h, qh, plan.local_kv(kh), plan.local_kv(vh), out_h, lse_h, setup)
        dk_h, dv_h = plan.reduce_local_kv(dk_h, kh.shape[1]), plan.reduce_local_kv(dv_h, vh.shape[1])
        ranges = [plan.q_ranges, plan.kv_ranges, plan.kv_ranges]
        dq, dk, dv = gather_grads(_heads_to_seq([dq_h, dk_h, dv_h], ranges, setup), plan.kv_ranges, ctx.n_kv)
        return dq, dk, dv, None


ALLTOALL = Strategy(
    "alltoall", AllToAllAttention, saves="head_shards", block_size=lambda world, alltoall_size: world,
    cost=RING_FAMILY, whole_sequence_call=True,
)
"""Ulysses over the whole CP group (the all-to-all family with one block of every rank)."""
