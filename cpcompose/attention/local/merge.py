"""Merging partial attention results through the log-sum-exp, in float32.

A block of keys gives each query a partial output `o_b` (softmax over that block
only) and its log-sum-exp `l_b`. Two partials combine exactly as

    l = logaddexp(l_a, l_b),   o = sigmoid(l_a - l_b) * o_a + sigmoid(l_b - l_a) * o_b

which never exponentiates a positive number, so nothing overflows, and starting
from `l_a = -inf, o_a = 0` the first merge simply copies the block. Each weight is
its own sigmoid (not `1 - w`, which rounds to 0 once the other weight rounds to 1),
so an infinite value in V stays infinite through the merge exactly as it does in a
single softmax, instead of becoming `inf - inf = nan`. The
accumulators are float32 whatever the input dtype: rounding each partial into
bf16 and adding in bf16 is how errors grow with the ring size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpcompose.comm import rehearsing
from cpcompose.precision import accumulation_dtype

__all__ = ["SoftmaxAccumulator", "fold_sinks", "keep_nan_rows"]


class SoftmaxAccumulator:
    """Running `(out, lse)` for the local queries, merged block by block.

    Args:
        like: the local query tensor `(B, H, S, D)`; sets shape and device.
        value_dim: head dim of V (the output's last dim).
    """

    def __init__(self, like: Tensor, value_dim: int) -> None:
        b, h, s, _ = like.shape
        acc = accumulation_dtype(like.dtype)
        self.out = torch.zeros(b, h, s, value_dim, dtype=acc, device=like.device)
        self.lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=like.device)
        self._queries = like
        self._touched: list[tuple[int, int]] = []  # row ranges some block has written

    def merge(self, rows: slice, block_out: Tensor, block_lse: Tensor) -> None:
        """Fold one block's result for query rows `rows` into the running result.

        The first block to reach a row range is copied in (what the merge would
        compute from `-inf`, exactly): on packed batches most rows see a few small
        blocks, and the merge's half-dozen passes over the output cost as much as
        the kernel calls themselves.
        """
        out, lse = self.out[:, :, rows], self.lse[:, :, rows]
        if not any(a < rows.stop and rows.start < b for a, b in self._touched):
            self._touched.append((rows.start, rows.stop))
            out.copy_(block_out)
            lse.copy_(block_lse)
            return
        self._touched.append((rows.start, rows.stop))
        block_lse = block_lse.to(lse.dtype)
        keep = torch.sigmoid(lse - block_lse).unsqueeze(-1)
        take = torch.sigmoid(block_lse - lse).unsqueeze(-1)
        out.mul_(keep).add_(take * block_out.to(out.dtype))
        torch.logaddexp(lse, block_lse, out=lse)

    def finish(self) -> tuple[Tensor, Tensor]:
        """The merged `(out, lse)`, NaN wherever a query row holds a NaN (see `keep_nan_rows`)."""
        keep_nan_rows(self._queries, self.out, self.lse)
        return self.out, self.lse


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Attention sinks joined to a merged `(out, lse)`, once: a per-head logit with no value (gpt-oss).

    The softmax then runs over the keys and the sink, so every row's weights shrink by
    `exp(lse - lse')` with `lse' = logaddexp(lse, sink)`. A strategy folds them in before it
    saves `(out, lse)` for its backward: the kernels' backward, given the folded pair,
    computes exactly the gradients of the softmax with the sink (the sink's own gradient,
    `-sum_i exp(sink - lse'_i) * (dout_i . out_i)`, is `SinkGradient`'s in `api.py`).

    Args:
        out, lse: the merged float32 (float64) `(B, H, S, Dv)` and `(B, H, S)`.
        sinks: `(H,)`, this call's heads' sink logits.
    """
    total = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - total).unsqueeze(-1), total


def keep_nan_rows(q: Tensor, out: Tensor, lse: Tensor) -> None:
    """Set `out` and `lse` to NaN (in place) on every query row of `q` that holds a NaN.

    The fused CPU kernel answers a NaN query row in a small block like a fully masked
    one (out 0, lse 0) and in a large block with NaN; CP computes small blocks, so
    without this a NaN could vanish where a single-process SDPA keeps it.

    On the CPU one sum of `q` answers first whether any NaN is there at all (a NaN
    always reaches the sum); the row-wise pass, 20x dearer, runs only then (or when
    infinities of both signs make the sum NaN). On other devices the pass runs
    unconditionally: the test would be a host synchronisation; so it does in a rehearsal
    (`comm.rehearsal_mode`), whose fake tensors have no sum to read.
    """
    if q.device.type == "cpu" and not rehearsing() and not torch.isnan(q.sum()):
        return
    nan_rows = torch.isnan(q).any(dim=-1)
    out.masked_fill_(nan_rows.unsqueeze(-1), float("nan"))
    lse.masked_fill_(nan_rows, float("nan"))
