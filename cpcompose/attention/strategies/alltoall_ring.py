"""2-D attention ("alltoall_ring"): Ulysses inside blocks of ranks, a ring across the blocks.

The P ranks of the CP group form P / a blocks of a = `alltoall_size` consecutive
ranks (block g: ranks g*a .. g*a+a-1; under torchrun consecutive ranks share a
node, so the all-to-all stays on the fast links). No new process group is made:

1. Inside each block, one all-to-all trades sequence for heads (the split and the
   GQA rules of `alltoall.py`: uneven head counts, K/V heads sent only where read,
   never expanded before communication). Rank (g, i) then holds heads i of the
   block's tokens, which `GroupedLayout` describes as a split over P / a places.
2. Across blocks, the ranks at the same place i run the ring of `ring.py` over that
   grouped layout (rank r talks to r +- a): K/V rows the peer's block plan reads,
   posted a round ahead; a halo under windows, only shared documents when packed.
   Outputs and LSEs merge in float32.
3. One all-to-all returns the output (and the LSE when asked for) to sequence shards.

Backward: dO goes to heads, the ring repeats its K/V exchange and sends each block's
float32 dK/dV home, and one all-to-all returns dQ/dK/dV. `alltoall_size = P` is
Ulysses and 1 is the ring, both through this code.

The meter counts the all-to-all dimension as "all_to_all" and the ring dimension as
"p2p"; the cost model (`cost/traffic.py`, the all-to-all family with blocks of
`alltoall_size` ranks) counts both exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.local.call_setup import AttentionSetup
from cpcompose.attention.cost.model import RING_FAMILY
from cpcompose.attention.local.heads import HeadGroup, HeadPlan, gather_grads, head_plan, heads_to_seq, seq_to_heads
from cpcompose.attention.local.merge import SoftmaxAccumulator, fold_sinks
from cpcompose.attention.strategies.ring_loop import RingView, Rounds, ring_backward, ring_forward
from cpcompose.attention.strategies.strategy import Strategy
from cpcompose.comm import RingComm
from cpcompose.layouts.grouped import grouped

__all__ = ["ALLTOALL_RING", "AllToAllRingAttention"]


class _Mesh:
    """This rank's place on the 2-D mesh of one call: its block, its heads, its ring."""

    def __init__(self, setup: AttentionSetup, n_heads: int, n_kv: int, local_seq: int, device: torch.device) -> None:
        cp, a = setup.cp, setup.alltoall_size
        assert a is not None and cp.world % a == 0, "checked by CPOptions.error before any communication"
        self.group = HeadGroup.of(cp, a)
        self.block = cp.rank // a
        self.plan: HeadPlan = head_plan(n_heads, n_kv, a, self.group.index, device)
        self.layout = grouped(setup.layout, a)
        self.seq_len = local_seq * cp.world
        self.view = RingView(self.block, cp.world // a, stride=a, offset=self.group.index)
        self.setup = setup

    def to_heads(self, tensors: list[Tensor], ranges: list[list[tuple[int, int]]]) -> list[Tensor]:
        """Sequence shards -> this rank's heads of its block's tokens, in the grouped layout's order."""
        heads = seq_to_heads(tensors, ranges, self.setup.cp, self.setup.meter, self.group)
        if self.group.size == 1:  # one member: its order already is the block's
            return heads
        order = self.layout.from_member_order(self.block, self.seq_len, heads[0].device)
        return [t.index_select(2, order) for t in heads]

    def to_seq(self, tensors: list[Tensor], ranges: list[list[tuple[int, int]]]) -> list[list[Tensor]]:
        """The inverse: per block member, its head pieces of this rank's tokens."""
        if self.group.size > 1:
            order = self.layout.to_member_order(self.block, self.seq_len, tensors[0].device)
            tensors = [t.index_select(2, order) for t in tensors]
        return heads_to_seq(tensors, ranges, self.setup.cp, self.setup.meter, self.group)

    def rounds(self, local_seq: int) -> Rounds:
        return Rounds(self.layout, self.setup.mask, self.view, local_seq)


class AllToAllRingAttention(torch.autograd.Function):
    """`(q, k, v) -> (out, lse)` on local shards; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
        mesh = _Mesh(setup, q.shape[1], k.shape[1], q.shape[2], q.device)
        plan = mesh.plan
        qh, kh, vh = mesh.to_heads([q, k, v], [plan.q_ranges, plan.kv_ranges, plan.kv_ranges])
        acc = SoftmaxAccumulator(qh, vh.shape[-1])
        if qh.shape[1]:  # a place with no query heads (H < a) has none on any block: its ring is idle
            comm = RingComm(setup.cp, setup.meter)
            ring_forward(acc, qh, kh, vh, mesh.rounds(qh.shape[2]), comm, setup.kernel, plan)
        out_h, lse_h = acc.finish()
        sinks = setup.head_sinks(plan.q_ranges[mesh.group.index])
        if sinks is not None:
            out_h, lse_h = fold_sinks(out_h, lse_h, sinks)
        out_h = out_h.to(q.dtype)
        (out_parts,) = zip(*mesh.to_seq([out_h], [plan.q_ranges]))
        if setup.need_lse:
            (lse_parts,) = zip(*mesh.to_seq([lse_h.unsqueeze(-1)], [plan.q_ranges]))
            lse = torch.cat(lse_parts, dim=1).squeeze(-1)
        else:  # nobody asked: spare the exchange
            lse = lse_h.new_empty(0)
        ctx.save_for_backward(qh, kh, vh, out_h, lse_h)
        ctx.setup, ctx.n_kv = setup, k.shape[1]
        ctx.mark_non_differentiable(lse)
        return torch.cat(out_parts, dim=1), lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
        qh, kh, vh, out_h, lse_h = ctx.saved_tensors
        setup: AttentionSetup = ctx.setup
        mesh = _Mesh(setup, dout.shape[1], ctx.n_kv, dout.shape[2], dout.device)
        plan = mesh.plan
        (dout_h,) = mesh.to_heads([dout.contiguous()], [plan.q_ranges])
        if qh.shape[1]:
            comm = RingComm(setup.cp, setup.meter)
            dq_h, dk_h, dv_h = ring_backward(
                dout_h, qh, kh, vh, out_h, lse_h, mesh.rounds(qh.shape[2]), comm, setup.kernel, plan,
                pieces=setup.ring_tiles,
            )
        else:
            dq_h, dk_h, dv_h = qh, kh, vh  # no heads: empty
        dtype = qh.dtype
        grads = [dq_h.to(dtype), dk_h.to(dtype), dv_h.to(dtype)]
        recv = mesh.to_seq(grads, [plan.q_ranges, plan.kv_ranges, plan.kv_ranges])
        dq, dk, dv = gather_grads(recv, plan.kv_ranges, ctx.n_kv)
        return dq, dk, dv, None


def _alltoall_size(world: int, alltoall_size: int | None) -> int:
    """The block size the options name (checked by `CPOptions.error` before any call runs)."""
    if alltoall_size is None or isinstance(alltoall_size, bool) or alltoall_size < 1 or world % alltoall_size:
        raise ValueError(
            f"alltoall_ring needs an alltoall_size dividing the CP group size {world}, got {alltoall_size}"
        )
    return alltoall_size


def _candidate_sizes(world: int) -> list[int | None]:
    """Every block size between the ring's (1) and all-to-all's (P): those two are strategies of their own."""
    return [a for a in range(2, world) if world % a == 0]


ALLTOALL_RING = Strategy(
    "alltoall_ring", AllToAllRingAttention, saves="head_shards", block_size=_alltoall_size, cost=RING_FAMILY,
    takes_alltoall_size=True, candidate_sizes=_candidate_sizes,
)
"""2-D: all-to-all inside blocks of `alltoall_size` consecutive ranks, the ring across them."""
