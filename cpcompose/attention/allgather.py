"""All-gather attention (Llama 3 style): gather the whole K/V, attend locally.

Forward all-gathers K and V in one collective (GQA K/V travel with their own head
count), reorders them into global order and runs the local queries against the
visible blocks only. Backward gathers K/V again instead of keeping the full copy
alive between forward and backward (activation memory stays 1/P), computes dK/dV
for the whole sequence in float32 and reduce-scatters them to their owners.
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


def _gather_kv(k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
    """Full K and V in global order, `(B, Hkv, L, D)` each."""
    stacked = all_gather(torch.stack([k, v]), setup.cp, setup.meter)  # (P, 2, B, H, S, D)
    full = torch.cat(stacked.unbind(0), dim=3)  # rank-major along the sequence
    full = setup.layout.to_global_order(full, dim=3)
    return full[0], full[1]


class AllGatherAttention(torch.autograd.Function):
    """`(q, k, v) -> (out, lse)` on local shards; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
        k_full, v_full = _gather_kv(k, v, setup)
        acc = SoftmaxAccumulator(q, v.shape[-1])
        forward_blocks(acc, q, k_full, v_full, setup.tasks_against_all(q.shape[2]), setup.kernel)
        return finish_forward(ctx, q, k, v, acc, setup)

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        setup: AttentionSetup = ctx.setup
        k_full, v_full = _gather_kv(k, v, setup)
        acc_dtype = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dkv = torch.zeros((2, *k_full.shape), dtype=acc_dtype, device=q.device)
        tasks = setup.tasks_against_all(q.shape[2])
        backward_blocks((dq, dkv[0], dkv[1]), dout.contiguous(), q, k_full, v_full, out, lse, tasks, setup.kernel)
        # Back to rank-major order, one slice per rank, then sum over ranks.
        per_rank = setup.layout.to_rank_major(dkv, dim=3).chunk(setup.cp.world, dim=3)
        dk, dv = reduce_scatter(torch.stack(per_rank), setup.cp, setup.meter)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
