"""The steps of an all-to-all (Ulysses) call: trade sequence shards for head shards and back, and attend a rank's
heads over the whole sequence.

Written once for plain all-to-all attention (`alltoall.py`), which runs them on all heads at once, and the
head-chunked variant (`alltoall_chunked.py`), which runs them on one chunk of heads at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpcompose.attention.local.blocks import one_kernel_call
from cpcompose.attention.local.call_setup import AttentionSetup, float_zeros
from cpcompose.attention.local.execute import backward_blocks, forward_blocks
from cpcompose.attention.local.heads import HeadGroup, HeadRange, heads_to_seq, seq_to_heads
from cpcompose.attention.local.kernels import attention_backward, attention_forward
from cpcompose.attention.local.merge import SoftmaxAccumulator, fold_sinks, keep_nan_rows

__all__ = ["attend_heads", "attend_heads_backward", "to_head_shards", "to_seq_shards"]


def to_head_shards(
    tensors: list[Tensor], ranges: list[list[HeadRange]], setup: AttentionSetup
) -> list[Tensor]:
    """Sequence shards `(B, H_i, S, D)` -> head shards `(B, n_i, L, D)` in global order."""
    group = HeadGroup(0, setup.cp.world, setup.cp.rank)
    heads = seq_to_heads(tensors, ranges, setup.cp, setup.meter, group)
    return [setup.layout.to_global_order(t, dim=2) for t in heads]


def to_seq_shards(
    tensors: list[Tensor], ranges: list[list[HeadRange]], setup: AttentionSetup
) -> list[list[Tensor]]:
    """Head shards in global order -> per source rank, its `(B, n_src, S, D)` piece of our tokens."""
    group = HeadGroup(0, setup.cp.world, setup.cp.rank)
    rank_major = [setup.layout.to_rank_major(t, dim=2) for t in tensors]
    return heads_to_seq(rank_major, ranges, setup.cp, setup.meter, group)


def attend_heads(
    q: Tensor, k: Tensor, v: Tensor, setup: AttentionSetup, sinks: Tensor | None
) -> tuple[Tensor, Tensor]:
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


def attend_heads_backward(
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
