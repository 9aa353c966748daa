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
"p2p"; `predicted_bytes` gives both in closed form for the uniform layouts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.alltoall import (
    HeadGroup,
    _HeadPlan,
    gather_grads,
    head_plan,
    heads_to_seq,
    kv_head_ranges,
    query_head_ranges,
    seq_to_heads,
)
from cpcompose.attention.blocks import MaskSpec
from cpcompose.attention.merge import SoftmaxAccumulator
from cpcompose.attention.ring import Rounds, RingView, ring_backward, ring_forward, ring_round
from cpcompose.attention.call_setup import AttentionSetup
from cpcompose.comm import RingComm
from cpcompose.layouts import Layout, resolve_layout
from cpcompose.layouts.grouped import grouped


class _Mesh:
    """This rank's place on the 2-D mesh of one call: its block, its heads, its ring."""

    def __init__(self, setup: AttentionSetup, n_heads: int, n_kv: int, local_seq: int, device: torch.device) -> None:
        cp, a = setup.cp, setup.alltoall_size
        assert a is not None and cp.world % a == 0, "checked by CPOptions.error before any communication"
        self.group = HeadGroup.of(cp, a)
        self.block = cp.rank // a
        self.plan: _HeadPlan = head_plan(n_heads, n_kv, a, self.group.index, device)
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
                dout_h, qh, kh, vh, out_h, lse_h, mesh.rounds(qh.shape[2]), comm, setup.kernel, plan
            )
        else:
            dq_h, dk_h, dv_h = qh, kh, vh  # no heads: empty
        dtype = qh.dtype
        grads = [dq_h.to(dtype), dk_h.to(dtype), dv_h.to(dtype)]
        recv = mesh.to_seq(grads, [plan.q_ranges, plan.kv_ranges, plan.kv_ranges])
        dq, dk, dv = gather_grads(recv, plan.kv_ranges, ctx.n_kv)
        return dq, dk, dv, None


def ring_rows(layout: Layout, mask: MaskSpec, seq_len: int, alltoall_size: int, rank: int) -> tuple[int, int]:
    """Token rows of K/V that `rank` sends, and receives, over the ring dimension in one forward.

    Exact for any layout and mask (documents, windows): the ring's own round plans on
    the blocks' `GroupedLayout`, which is what the strategy sends.
    """
    blocks = grouped(layout, alltoall_size)
    place, places = rank // alltoall_size, blocks.world
    sent = received = 0
    for s in range(1, places):
        plan = ring_round(blocks, mask, seq_len, place, places, s)
        sent += sum(r.stop - r.start for r in plan.send)
        received += sum(r.stop - r.start for r in plan.recv)
    return sent, received


def predicted_bytes(
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    local_seq: int,
    world: int,
    alltoall_size: int,
    rank: int,
    itemsize: int,
    causal: bool,
    layout: str | Layout = "zigzag",
    window: tuple[int | None, int | None] | None = None,
    v_dim: int | None = None,
    need_lse: bool = True,
    backward: bool = True,
) -> dict[str, int]:
    """Bytes `rank` sends in one "alltoall_ring" call, per mesh dimension, as the meter counts them.

    The all-to-all dimension depends on shapes only. The ring dimension has a closed
    form for one document under the "zigzag" or "contiguous" layout, causal or full,
    without a window; for a `Layout` object (packed documents) or a window it counts
    the rows the block planner sends (`ring_rows`). Forward only, or forward plus backward.

    Args:
        batch, heads, kv_heads, head_dim, v_dim: the call's shapes (v_dim defaults to head_dim).
        local_seq: tokens per rank (S = L / P).
        world: CP ranks P; alltoall_size: ranks per all-to-all block a (divides P).
        rank: the CP rank whose sends are counted (uneven head splits differ per rank).
        itemsize: bytes per element of q, k, v (4 for float32, 2 for bf16).
        causal: causal mask.
        layout: "zigzag", "contiguous", or a `Layout` over `world` ranks (e.g. a `PackedLayout`).
        window: `(left, right)` window sizes, None for unbounded on a side; None: no window.
        need_lse: the caller asked for the LSE (forward sends it home).
        backward: count the backward pass too.

    Returns:
        {"all_to_all": bytes over the all-to-all dimension, "p2p": bytes over the ring dimension}.
    """
    a, dv = alltoall_size, head_dim if v_dim is None else v_dim
    i, place, places = rank % a, rank // a, world // a
    acc = max(itemsize, 4)  # float32 accumulators (LSE, ring dK/dV); float64 stays float64
    q_ranges = query_head_ranges(heads, a)
    kv_ranges = kv_head_ranges(q_ranges, heads // kv_heads)
    nq = [hi - lo for lo, hi in q_ranges]
    nkv = [hi - lo for lo, hi in kv_ranges]
    s, b = local_seq, batch
    a2a = 0
    if a > 1:
        others = [j for j in range(a) if j != i]
        a2a += sum(b * s * (nq[j] * head_dim + nkv[j] * (head_dim + dv)) for j in others) * itemsize  # q, k, v in
        a2a += (a - 1) * b * s * nq[i] * dv * itemsize  # out home
        a2a += (a - 1) * b * s * nq[i] * acc if need_lse else 0  # LSE home
        if backward:
            a2a += sum(b * s * nq[j] * dv for j in others) * itemsize  # dO in
            a2a += (a - 1) * b * s * (nq[i] * head_dim + nkv[i] * (head_dim + dv)) * itemsize  # dQ, dK, dV home
    row = b * nkv[i] * (head_dim + dv) if nq[i] else 0  # elements of one token of this place's K/V heads
    block = a * s  # tokens of one place
    later, earlier = places - 1 - place, place  # peers place+k that do / do not wrap around
    if isinstance(layout, Layout) or window is not None:
        base = layout if isinstance(layout, Layout) else resolve_layout(layout, world)
        sent, received = ring_rows(base, MaskSpec(causal, *(window or (None, None))), s * world, a, rank)
    elif layout not in ("zigzag", "contiguous"):
        raise ValueError(f"layout={layout!r}: give a Layout object, or 'zigzag' or 'contiguous'")
    elif not causal:
        sent = received = (places - 1) * block
    elif layout == "zigzag":  # later places read only this place's early half; earlier ones all of it
        sent, received = later * block // 2 + earlier * block, earlier * block // 2 + later * block
    else:  # contiguous: later places read all of it, earlier ones nothing
        sent, received = later * block, earlier * block
    p2p = sent * row * itemsize
    if backward:  # K/V again; float32 dK/dV of the rows I read, sent to their owners
        p2p += sent * row * itemsize + received * row * acc
    return {"all_to_all": a2a, "p2p": p2p}
