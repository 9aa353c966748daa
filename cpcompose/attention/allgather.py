"""All-gather attention (Llama 3 style): gather the whole K/V, attend locally.

Forward all-gathers K and V in one collective (GQA K/V travel with their own head
count; each rank sends its K and V flattened end to end, so V may have its own head
dim, as in MLA, and every gathered shard is a contiguous view) and runs the local queries against each rank's gathered shard in place, with
the block plans the ring uses for that pair of ranks. Nothing is reordered into
global order: a full-sequence copy (and, in backward, a second one for the
gradients) cost as much as the kernels on packed batches of short documents.
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
from cpcompose.attention.setup import AttentionSetup, finish_forward
from cpcompose.comm import all_gather, reduce_scatter
from cpcompose.precision import accumulation_dtype


def _gather_kv(k: Tensor, v: Tensor, setup: AttentionSetup) -> list[tuple[Tensor, Tensor]]:
    """Every rank's `(K, V)` shards, in rank order, as contiguous views of one gathered buffer."""
    flat = all_gather(torch.cat([k.reshape(-1), v.reshape(-1)]), setup.cp, setup.meter)  # (P, |K| + |V|)
    return _split_kv(flat, k, v)


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
        for src, (k_src, v_src) in enumerate(_gather_kv(k, v, setup)):
            forward_blocks(acc, q, k_src, v_src, setup.tasks_between(rank, src, seq), setup.kernel)
        return finish_forward(ctx, q, k, v, acc, setup)

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        setup: AttentionSetup = ctx.setup
        seq, rank, world = q.shape[2], setup.cp.rank, setup.cp.world
        acc_dtype = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dkv = torch.zeros((world, k.numel() + v.numel()), dtype=acc_dtype, device=q.device)  # one collective
        dout = dout.contiguous()
        for src, ((k_src, v_src), (dk_src, dv_src)) in enumerate(zip(_gather_kv(k, v, setup), _split_kv(dkv, k, v))):
            tasks = setup.tasks_between(rank, src, seq)
            backward_blocks((dq, dk_src, dv_src), dout, q, k_src, v_src, out, lse, tasks, setup.kernel)
        (dk, dv), = _split_kv(reduce_scatter(dkv, setup.cp, setup.meter)[None], k, v)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
