"""Head-chunked all-to-all attention (UPipe, "Untied Ulysses", arXiv 2602.21196): Ulysses a chunk of heads at a time.

Plain all-to-all attention (`alltoall.py`) trades the sequence shards of all H heads for full-sequence shards of
H/P heads in one exchange and keeps those head shards (q, k, v, out, LSE) for backward, so its exchange buffers and
the full-sequence working set of the attention scale with all the heads. With `head_chunks` = n > 1 (`CPOptions`)
the call runs n chunks of heads one after another, each an ordinary Ulysses exchange of H/n query heads and the
K/n K/V heads they read (n divides K, so every GQA group stays whole inside one chunk):

* forward, per chunk: all-to-all the chunk's q, k, v to head shards of the whole sequence, attend (the same kernel
  calls as `alltoall.py`), all-to-all its output and LSE back into this rank's `(B, H, S)` out and LSE;
* saved for backward: only the local q, k, v, out and LSE (sequence shards, as a ring strategy saves);
* backward, per chunk: all-to-all the chunk's q, k, v, out, dO and LSE again, the attention backward, all-to-all
  dQ, dK, dV back into this rank's gradients.

So every buffer beyond the local shards is one chunk's: its query-side part (q, out, dO, dQ, the float32
accumulators) is 1/n of plain Ulysses's; its K/V part too while a chunk's K/n K/V heads are at least P, else each rank
still receives the one K/V head its query heads read (GQA: a head read by several ranks goes to each). The price is
communication, which the cost model counts exactly (`cost/traffic.py`): backward exchanges q, k, v and out again, 1.5x
plain Ulysses's all-to-all bytes when K/n >= P (6 (H + K) against 4 (H + K) head rows per token, plus the LSE
twice), more when K/V heads go to several ranks (Llama-3-8B's 32/8 heads on 8 ranks: 1.8x at n = 2, 2.4x at n = 4),
in 3n + 3n all-to-all calls instead of 2-3 + 2. Each chunk runs the plain strategy's steps (`alltoall_steps.py`) on
its heads: the same kernel calls and merges, head by head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpcompose.attention.local.call_setup import AttentionSetup
from cpcompose.attention.local.heads import HeadPlan, HeadRange, gather_grads, head_plan
from cpcompose.attention.strategies.alltoall_steps import (
    attend_heads, attend_heads_backward, to_head_shards, to_seq_shards,
)
from cpcompose.precision import accumulation_dtype

__all__ = ["ChunkedAllToAllAttention", "head_chunks_error"]


def head_chunks_error(n_heads: int, n_kv: int, chunks: int, world: int, *, key: str = "head_chunks") -> str | None:
    """Why `chunks` chunks of heads cannot run on a CP group of `world` ranks, or None (`key`: the option's name).

    Each chunk must hold whole GQA groups (`chunks` divides the K/V heads) and give every rank a query head: a chunk
    with fewer query heads than ranks leaves some idle and holds, on the others, as much as a chunk of `world` heads
    would, so it only costs time.
    """
    if chunks == 1:
        return None
    fits = [n for n in range(1, n_kv + 1) if n_kv % n == 0 and n_heads // n >= world]
    most = f"; {key} = {max(fits)} is the most this model and CP group allow" if fits else ""
    if n_kv % chunks:
        return f"{key}={chunks} must divide the {n_kv} key/value heads (each chunk holds whole GQA groups){most}"
    if n_heads // chunks < world:
        return (f"{key}={chunks} leaves {n_heads // chunks} query heads per chunk for {world} CP ranks (each rank "
                f"needs a query head of every chunk){most}")
    return None


class _Chunks:
    """The head slices of one call's chunks and the head plan they share (every chunk has the same shape)."""

    def __init__(self, setup: AttentionSetup, n_heads: int, n_kv: int, device: torch.device) -> None:
        n = setup.head_chunks
        self.heads, self.kv_heads, self.count = n_heads // n, n_kv // n, n
        self.plan: HeadPlan = head_plan(self.heads, self.kv_heads, setup.cp.world, setup.cp.rank, device)
        self.qkv_ranges = [self.plan.q_ranges, self.plan.kv_ranges, self.plan.kv_ranges]

    def q(self, c: int) -> slice:
        return slice(c * self.heads, (c + 1) * self.heads)

    def kv(self, c: int) -> slice:
        return slice(c * self.kv_heads, (c + 1) * self.kv_heads)

    def own_heads(self, c: int, rank: int) -> HeadRange:
        """This rank's query heads of chunk `c`, numbered among all H heads (for the sinks)."""
        lo, hi = self.plan.q_ranges[rank]
        return c * self.heads + lo, c * self.heads + hi


class ChunkedAllToAllAttention(torch.autograd.Function):
    """`(q, k, v) -> (out, lse)` on local shards, `setup.head_chunks` chunks of heads at a time (module docstring).

    `AllToAllAttention` hands its calls with `head_chunks` > 1 here; the LSE always comes back (backward needs it).
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup) -> tuple[Tensor, Tensor]:
        chunks = _Chunks(setup, q.shape[1], k.shape[1], q.device)
        plan, rank = chunks.plan, setup.cp.rank
        b, h, s, _ = q.shape
        out = q.new_empty((b, h, s, v.shape[-1]))
        lse = q.new_empty((b, h, s), dtype=accumulation_dtype(q.dtype))
        for c in range(chunks.count):
            qh, kh, vh = to_head_shards([q[:, chunks.q(c)], k[:, chunks.kv(c)], v[:, chunks.kv(c)]],
                                      chunks.qkv_ranges, setup)
            out_h, lse_h = attend_heads(qh, plan.local_kv(kh), plan.local_kv(vh), setup,
                                        setup.head_sinks(chunks.own_heads(c, rank)))
            del qh, kh, vh  # the chunk's head shards: recomputed in backward
            _place(out[:, chunks.q(c)], to_seq_shards([out_h], [plan.q_ranges], setup), plan.q_ranges)
            lse_parts = to_seq_shards([lse_h.unsqueeze(-1)], [plan.q_ranges], setup)
            _place(lse[:, chunks.q(c)].unsqueeze(-1), lse_parts, plan.q_ranges)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = setup
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        setup: AttentionSetup = ctx.setup
        chunks = _Chunks(setup, q.shape[1], k.shape[1], q.device)
        plan = chunks.plan
        dout = dout.to(q.dtype)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for c in range(chunks.count):
            qs, ks = chunks.q(c), chunks.kv(c)
            qh, kh, vh, out_h, dout_h = to_head_shards(
                [q[:, qs], k[:, ks], v[:, ks], out[:, qs], dout[:, qs]],
                [*chunks.qkv_ranges, plan.q_ranges, plan.q_ranges], setup,
            )
            (lse_h,) = to_head_shards([lse[:, qs].unsqueeze(-1)], [plan.q_ranges], setup)
            dq_h, dk_h, dv_h = attend_heads_backward(
                dout_h, qh, plan.local_kv(kh), plan.local_kv(vh), out_h, lse_h.squeeze(-1), setup
            )
            del qh, out_h, dout_h, lse_h
            dk_h, dv_h = plan.reduce_local_kv(dk_h, kh.shape[1]), plan.reduce_local_kv(dv_h, vh.shape[1])
            dq[:, qs], dk[:, ks], dv[:, ks] = gather_grads(
                to_seq_shards([dq_h, dk_h, dv_h], chunks.qkv_ranges, setup), plan.kv_ranges, chunks.kv_heads
            )
        return dq, dk, dv, None


def _place(into: Tensor, parts: list[list[Tensor]], ranges: list[HeadRange]) -> None:
    """Write each member's head piece (`parts[m][0]`, heads `ranges[m]` of the chunk) into `into` (a view)."""
    for (lo, hi), (piece,) in zip(ranges, parts):
        into[:, lo:hi] = piece
