"""All-to-all attention (Ulysses): trade sequence shards for head shards and back.

One all-to-all gives every rank the whole sequence for a subset of the heads; it
attends locally with the full-sequence kernel, and a second all-to-all returns
the output to sequence shards. Works for any head count:

* Query heads are split as evenly as possible (H=10 over P=4 gives 3,3,2,2); a
  rank may get none when H < P.
* Each rank receives exactly the K/V heads its query heads read. When K/V heads
  divide evenly this is a disjoint split (no duplication); when they do not, or
  when there are fewer K/V heads than ranks, a K/V head goes to each rank that
  needs it, and no further. Nothing is expanded to the query head count before
  the exchange; a rank whose query heads straddle K/V groups unevenly expands
  locally, after communication, and sums those gradients back before sending.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.blocks import backward_blocks, forward_blocks
from cpcompose.attention.kernels import attention_backward, attention_forward
from cpcompose.attention.merge import SoftmaxAccumulator, keep_nan_rows
from cpcompose.attention.setup import AttentionSetup, float_zeros
from cpcompose.comm import all_to_all_pieces
from cpcompose.precision import accumulation_dtype

HeadRange = tuple[int, int]


def query_head_ranges(n_heads: int, world: int) -> list[HeadRange]:
    """Contiguous, as-even-as-possible split of `n_heads` over `world` ranks."""
    base, extra = divmod(n_heads, world)
    ranges, lo = [], 0
    for j in range(world):
        hi = lo + base + (1 if j < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def kv_head_ranges(q_ranges: list[HeadRange], group: int) -> list[HeadRange]:
    """The K/V heads each rank's query heads read (`group` query heads per K/V head)."""
    return [(lo // group, (hi - 1) // group + 1) if hi > lo else (0, 0) for lo, hi in q_ranges]


class _HeadPlan:
    """Who holds which heads, and how this rank's query heads map to its K/V heads.

    Read-only once built, and built once per (heads, K/V heads, world, rank, device)
    by `head_plan`: the same plan serves every call of every layer.
    """

    def __init__(self, n_heads: int, n_kv: int, world: int, rank: int, device: torch.device) -> None:
        group = n_heads // n_kv
        self.q_ranges = query_head_ranges(n_heads, world)
        self.kv_ranges = kv_head_ranges(self.q_ranges, group)
        (lo, hi), (klo, khi) = self.q_ranges[rank], self.kv_ranges[rank]
        nq, nk = hi - lo, khi - klo
        index = [h // group - klo for h in range(lo, hi)]
        native = nk > 0 and nq % nk == 0 and index == [i // (nq // nk) for i in range(nq)]
        self.kv_index = torch.tensor(index, dtype=torch.int64, device=device)
        self.expand = nq > 0 and not native  # kernel cannot map heads itself

    def local_kv(self, kv: Tensor) -> Tensor:
        return kv.index_select(1, self.kv_index) if self.expand else kv

    def reduce_local_kv(self, dkv: Tensor, n_kv: int) -> Tensor:
        if not self.expand:
            return dkv
        acc = accumulation_dtype(dkv.dtype)
        out = dkv.new_zeros((dkv.shape[0], n_kv, *dkv.shape[2:]), dtype=acc)
        return out.index_add_(1, self.kv_index, dkv.to(acc)).to(dkv.dtype)


@functools.lru_cache(maxsize=256)
def head_plan(n_heads: int, n_kv: int, world: int, rank: int, device: torch.device) -> _HeadPlan:
    """The cached `_HeadPlan` of this call's head counts."""
    return _HeadPlan(n_heads, n_kv, world, rank, device)


def _seq_to_heads(tensors: list[Tensor], ranges: list[list[HeadRange]], setup: AttentionSetup) -> list[Tensor]:
    """Sequence shards `(B, H_i, S, D)` -> head shards `(B, n_i, L, D)` in global order."""
    world, rank = setup.cp.world, setup.cp.rank
    send = [[t[:, r[j][0] : r[j][1]] for t, r in zip(tensors, ranges)] for j in range(world)]
    shapes = [
        torch.Size((t.shape[0], r[rank][1] - r[rank][0], t.shape[2], t.shape[3]))
        for t, r in zip(tensors, ranges)
    ]
    recv = all_to_all_pieces(send, [shapes] * world, setup.cp, setup.meter)
    return [
        setup.layout.to_global_order(torch.cat([recv[s][i] for s in range(world)], dim=2), dim=2)
        for i in range(len(tensors))
    ]


def _heads_to_seq(tensors: list[Tensor], ranges: list[list[HeadRange]], setup: AttentionSetup) -> list[list[Tensor]]:
    """Head shards in global order -> per source rank, its `(B, n_src, S, D)` piece of our tokens."""
    world = setup.cp.world
    rank_major = [setup.layout.to_rank_major(t, dim=2).chunk(world, dim=2) for t in tensors]
    send = [[rm[j] for rm in rank_major] for j in range(world)]
    seq = tensors[0].shape[2] // world
    shapes = [
        [torch.Size((t.shape[0], r[s][1] - r[s][0], seq, t.shape[3])) for t, r in zip(tensors, ranges)]
        for s in range(world)
    ]
    return all_to_all_pieces(send, shapes, setup.cp, setup.meter)


def _attend(q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
    """Full-sequence attention of this rank's heads (global order), masked by the layout's documents."""
    if q.shape[1] == 0:  # more ranks than query heads: this rank has nothing to attend
        return q.new_empty((*q.shape[:3], v.shape[-1])), q.new_empty(q.shape[:3], dtype=float_zeros(q).dtype)
    tasks = setup.tasks_full_sequence(q.shape[2])
    whole = slice(0, q.shape[2])
    if len(tasks) == 1 and tasks[0].q == tasks[0].kv == whole and tasks[0].kind != "band":
        out, lse = attention_forward(
            q, k, v, causal=tasks[0].kind == "causal", scale=setup.kernel.scale, backend=setup.kernel.backend,
            softcap=setup.kernel.softcap,
        )
        keep_nan_rows(q, out, lse)
        return out, lse
    acc = SoftmaxAccumulator(q, v.shape[-1])
    forward_blocks(acc, q, k, v, tasks, setup.kernel)
    out, lse = acc.finish()
    return out.to(q.dtype), lse


def _attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, setup: AttentionSetup
) -> tuple[Tensor, Tensor, Tensor]:
    if q.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    tasks = setup.tasks_full_sequence(q.shape[2])
    whole = slice(0, q.shape[2])
    if len(tasks) == 1 and tasks[0].q == tasks[0].kv == whole and tasks[0].kind != "band":
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
        out_h, lse_h = _attend(qh, plan.local_kv(kh), plan.local_kv(vh), setup)
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
        plan: _HeadPlan = ctx.plan
        (dout_h,) = _seq_to_heads([dout.contiguous()], [plan.q_ranges], setup)
        dq_h, dk_h, dv_h = _attend_backward(dout_h, qh, plan.local_kv(kh), plan.local_kv(vh), out_h, lse_h, setup)
        dk_h, dv_h = plan.reduce_local_kv(dk_h, kh.shape[1]), plan.reduce_local_kv(dv_h, vh.shape[1])
        ranges = [plan.q_ranges, plan.kv_ranges, plan.kv_ranges]
        recv = _heads_to_seq([dq_h, dk_h, dv_h], ranges, setup)
        dq = torch.cat([parts[0] for parts in recv], dim=1)
        b, seq = dq.shape[0], dq.shape[2]
        acc_dtype = accumulation_dtype(dq.dtype)
        dk = torch.zeros((b, ctx.n_kv, seq, kh.shape[-1]), dtype=acc_dtype, device=dq.device)
        dv = torch.zeros((b, ctx.n_kv, seq, vh.shape[-1]), dtype=acc_dtype, device=dq.device)
        for (klo, khi), parts in zip(plan.kv_ranges, recv):
            dk[:, klo:khi] += parts[1]
            dv[:, klo:khi] += parts[2]
        return dq, dk.to(dq.dtype), dv.to(dq.dtype), None
