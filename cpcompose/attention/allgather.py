"""All-gather attention (Llama 3 style): gather the whole K/V, attend locally.

Forward all-gathers K and V in one collective (GQA K/V travel with their own head
count; each rank sends its K and V flattened end to end, so V may have its own head
dim, as in MLA, and every gathered shard is a contiguous view) and runs the local
queries against each rank's gathered shard in place, with the block plans the ring
uses for that pair of ranks. Nothing is reordered into global order: a
full-sequence copy (and, in backward, a second one for the gradients) cost as much
as the kernels on packed batches of short documents. The collectives run while the
rank computes on its own K/V: the gather behind the local blocks (forward) or their
first half (backward), the gradients' reduce-scatter behind the second half.
Backward gathers K/V again instead of keeping the full copy alive between forward
and backward (activation memory stays 1/P), accumulates dK/dV for every rank's rows
in float32, already laid out rank by rank, and reduce-scatters them to their owners.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.blocks import backward_blocks, forward_blocks
from cpcompose.attention.merge import SoftmaxAccumulator
from cpcompose.attention.setup import AttentionSetup, finish_forward, float_zeros
from cpcompose.comm import PendingCollective, start_all_gather, start_reduce_scatter
from cpcompose.precision import accumulation_dtype


def _start_gather_kv(k: Tensor, v: Tensor, setup: AttentionSetup) -> PendingCollective:
    """Start gathering every rank's K and V, flattened end to end into one buffer `(P, |K| + |V|)`."""
    return start_all_gather(torch.cat([k.reshape(-1), v.reshape(-1)]), setup.cp, setup.meter)


def _split_kv(flat: Tensor, k: Tensor, v: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Rank p's row of `flat` as `(K-shaped, V-shaped)` views: contiguous, so no kernel call copies them."""
    n = k.numel()
    return [(row[:n].view(k.shape), row[n:].view(v.shape)) for row in flat.unbind(0)]


class AllGatherAttention(torch.autograd.Function):
    """`(q, k, v) -> (out, lse)` on local shards; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
        seq, rank = q.shape[2], setup.cp.rank
        acc = SoftmaxAccumulator(q, v.shape[-1])
        gathering = _start_gather_kv(k, v, setup)
        forward_blocks(acc, q, k, v, setup.tasks_between(rank, rank, seq), setup.kernel)  # own K/V meanwhile
        for src, (k_src, v_src) in enumerate(_split_kv(gathering.wait(), k, v)):
            if src != rank:
                forward_blocks(acc, q, k_src, v_src, setup.tasks_between(rank, src, seq), setup.kernel)
        return finish_forward(ctx, q, k, v, acc, setup)

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        setup: AttentionSetup = ctx.setup
        seq, rank, kernel = q.shape[2], setup.cp.rank, setup.kernel
        acc_dtype = accumulation_dtype(q.dtype)
        dout = dout.contiguous()
        gathering = _start_gather_kv(k, v, setup)
        dq = float_zeros(q)
        dkv = torch.zeros((setup.cp.world, k.numel() + v.numel()), dtype=acc_dtype, device=q.device)  # one collective
        grads = _split_kv(dkv, k, v)
        early, late = setup.local_halves(rank, seq)
        backward_blocks((dq, *grads[rank]), dout, q, k, v, out, lse, early, kernel)  # while K/V travel
        for src, (k_src, v_src) in enumerate(_split_kv(gathering.wait(), k, v)):
            if src != rank:
                tasks = setup.tasks_between(rank, src, seq)
                backward_blocks((dq, *grads[src]), dout, q, k_src, v_src, out, lse, tasks, kernel)
        reducing = start_reduce_scatter(dkv, setup.cp, setup.meter)
        late_grads = (float_zeros(k), float_zeros(v)) if late else None
        if late_grads is not None:  # while dK/dV travel
            backward_blocks((dq, *late_grads), dout, q, k, v, out, lse, late, kernel)
        dk, dv = _split_kv(reducing.wait()[None], k, v)[0]
        if late_grads is not None:  # the reduced dK/dV are this call's own buffer: add in place
            dk += late_grads[0]
            dv += late_grads[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
