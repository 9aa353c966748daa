"""All-gather attention (Llama 3 style): gather the whole K/V, attend locally.

Forward all-gathers K and V in one collective (GQA K/V travel with their own head
count; K and V are concatenated along the head dim, so V may have its own, as in
MLA), reorders them into global order and runs the local queries against the
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
    """Full K and V in global order, `(B, Hkv, L, Dk)` and `(B, Hkv, L, Dv)`."""
    stacked = all_gather(torch.cat([k, v], dim=3), setup.cp, setup.meter)  # (P, B, H, S, Dk + Dv)
    full = torch.cat(stacked.unbind(0), dim=2)  # rank-major along the sequence
    full = setup.layout.to_global_order(full, dim=2)
    return full[..., : k.shape[3]], full[..., k.shape[3] :]


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
        dkv = torch.zeros((*k_full.shape[:3], k.shape[3] + v.shape[3]), dtype=acc_dtype, device=q.device)
        dk_full, dv_full = dkv[..., : k.shape[3]], dkv[..., k.shape[3] :]  # views: one buffer, one collective
        tasks = setup.tasks_against_all(q.shape[2])
        backward_blocks((dq, dk_full, dv_full), dout.contiguous(), q, k_full, v_full, out, lse, tasks, setup.kernel)
        # Back to rank-major order, one slice per rank, then sum over ranks.
        per_rank = setup.layout.to_rank_major(dkv, dim=2).chunk(setup.cp.world, dim=2)
        dkv_mine = reduce_scatter(torch.stack(per_rank), setup.cp, setup.meter)
        dk, dv = dkv_mine[..., : k.shape[3]], dkv_mine[..., k.shape[3] :]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
