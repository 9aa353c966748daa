"""All-gather attention (Llama 3 style): gather the K/V others read, attend locally.

Forward all-gathers K and V in one collective (GQA K/V travel with their own head
count; each rank sends its K and V flattened end to end, so V may have its own head
dim, as in MLA, and every gathered shard is a contiguous view) and runs the local
queries against each rank's gathered shard in place, with the block plans the ring
uses for that pair of ranks. What travels is each rank's *needed* rows: those some
other rank's plan reads (`plans.gathered_rows`), packed in order and padded to the
longest rank's, with the plans renumbered to match. Under a causal mask or packed
documents that is much less than the whole shard (nobody else reads a causal zigzag
rank's late chunk; a packed rank's short documents stay home), and for a dense
bidirectional mask it is the whole shard, as in Llama 3 (and always above
`plans.COMPACT_GATHER_MAX_WORLD` ranks, where finding the rows would plan every pair
of ranks). Nothing is reordered into
global order: a full-sequence copy (and, in backward, a second one for the
gradients) cost as much as the kernels on packed batches of short documents. The
collectives run while the rank computes on its own K/V: the gather behind the local
blocks (forward) or their first half (backward), the gradients' reduce-scatter
behind the second half. Backward gathers K/V again instead of keeping the full copy
alive between forward and backward (activation memory stays 1/P), accumulates the
gathered rows' dK/dV in float32, laid out as they arrived, reduce-scatters them to
their owners, and adds them to the owner's own-block gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.local.call_setup import AttentionSetup, finish_forward, float_zeros
from cpcompose.attention.cost.model import GATHER
from cpcompose.attention.local.execute import backward_blocks, forward_blocks
from cpcompose.attention.local.merge import SoftmaxAccumulator
from cpcompose.attention.strategies.strategy import Strategy
from cpcompose.comm import PendingCollective, start_all_gather, start_reduce_scatter
from cpcompose.precision import accumulation_dtype

__all__ = ["ALLGATHER", "AllGatherAttention"]


def _packed_shapes(k: Tensor, v: Tensor, width: int) -> tuple[torch.Size, torch.Size]:
    """K's and V's shapes with `width` rows: one rank's part of the gathered buffer."""
    return k.shape[:2] + (width, k.shape[3]), v.shape[:2] + (width, v.shape[3])


def _start_gather_kv(
    k: Tensor, v: Tensor, rows: tuple[slice, ...], width: int, setup: AttentionSetup
) -> PendingCollective:
    """Start gathering every rank's needed K and V rows, packed and flattened end to end: `(P, |K| + |V|)`."""
    k_shape, v_shape = _packed_shapes(k, v, width)
    flat = k.new_empty(k_shape.numel() + v_shape.numel())
    k_part, v_part = flat[: k_shape.numel()].view(k_shape), flat[k_shape.numel() :].view(v_shape)
    at = 0
    for r in rows:
        n = r.stop - r.start
        k_part[:, :, at : at + n] = k[:, :, r]
        v_part[:, :, at : at + n] = v[:, :, r]
        at += n
    k_part[:, :, at:] = 0  # padding up to the longest rank's rows: sent, never read
    v_part[:, :, at:] = 0
    return start_all_gather(flat, setup.cp, setup.meter)


def _split_kv(flat: Tensor, k_shape: torch.Size, v_shape: torch.Size) -> list[tuple[Tensor, Tensor]]:
    """Rank p's row of `flat` as `(K-shaped, V-shaped)` views: contiguous, so no kernel call copies them."""
    n = k_shape.numel()
    return [(row[:n].view(k_shape), row[n:].view(v_shape)) for row in flat.unbind(0)]


def _needed(setup: AttentionSetup, seq: int) -> tuple[tuple[tuple[slice, ...], ...], int]:
    """Every rank's needed rows, and the gathered width (the most any rank has)."""
    return setup.gathered_rows(seq), setup.gathered_width(seq)


class AllGatherAttention(torch.autograd.Function):
    """`(q, k, v) -> (out, lse)` on local shards; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
        seq, rank = q.shape[2], setup.cp.rank
        rows, width = _needed(setup, seq)
        acc = SoftmaxAccumulator(q, v.shape[-1])
        if width == 0:  # no rank reads another's keys (every document within one rank): nothing to gather
            forward_blocks(acc, q, k, v, setup.tasks_between(rank, rank, seq), setup.kernel)
            return finish_forward(ctx, q, k, v, acc, setup)
        gathering = _start_gather_kv(k, v, rows[rank], width, setup)
        forward_blocks(acc, q, k, v, setup.tasks_between(rank, rank, seq), setup.kernel)  # own K/V meanwhile
        for src, (k_src, v_src) in enumerate(_split_kv(gathering.wait(), *_packed_shapes(k, v, width))):
            if src != rank:
                forward_blocks(acc, q, k_src, v_src, setup.tasks_on_gathered(rank, src, seq), setup.kernel)
        return finish_forward(ctx, q, k, v, acc, setup)

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        setup: AttentionSetup = ctx.setup
        seq, rank, kernel = q.shape[2], setup.cp.rank, setup.kernel
        rows, width = _needed(setup, seq)
        shapes = _packed_shapes(k, v, width)
        dout = dout.contiguous()
        dq, dk, dv = float_zeros(q), float_zeros(k), float_zeros(v)
        if width == 0:
            backward_blocks((dq, dk, dv), dout, q, k, v, out, lse, setup.tasks_between(rank, rank, seq), kernel)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
        gathering = _start_gather_kv(k, v, rows[rank], width, setup)
        numel = shapes[0].numel() + shapes[1].numel()
        dkv = torch.zeros((setup.cp.world, numel), dtype=accumulation_dtype(q.dtype), device=q.device)  # one collective
        grads = _split_kv(dkv, *shapes)
        early, late = setup.local_halves(rank, seq)
        backward_blocks((dq, dk, dv), dout, q, k, v, out, lse, early, kernel)  # while K/V travel
        for src, (k_src, v_src) in enumerate(_split_kv(gathering.wait(), *shapes)):
            if src != rank:
                tasks = setup.tasks_on_gathered(rank, src, seq)
                backward_blocks((dq, *grads[src]), dout, q, k_src, v_src, out, lse, tasks, kernel)
        reducing = start_reduce_scatter(dkv, setup.cp, setup.meter)
        backward_blocks((dq, dk, dv), dout, q, k, v, out, lse, late, kernel)  # while dK/dV travel
        dk_got, dv_got = _split_kv(reducing.wait()[None], *shapes)[0]
        at = 0
        for r in rows[rank]:  # the others' gradients for my needed rows, in the order they were sent
            n = r.stop - r.start
            dk[:, :, r] += dk_got[:, :, at : at + n]
            dv[:, :, r] += dv_got[:, :, at : at + n]
            at += n
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


ALLGATHER = Strategy(
    "allgather", AllGatherAttention, saves="inputs", block_size=lambda world, alltoall_size: world, cost=GATHER,
)
"""All-gather of the K/V rows others read (Llama 3 style), reduce-scatter of their gradients."""
