"""Merging partial attention results through the log-sum-exp, in float32.

A block of keys gives each query a partial output `o_b` (softmax over that block
only) and its log-sum-exp `l_b`. Two partials combine exactly as

    l = logaddexp(l_a, l_b),   o = o_a + sigmoid(l_b - l_a) * (o_b - o_a)

which never exponentiates a positive number, so nothing overflows, and starting
from `l_a = -inf, o_a = 0` the first merge simply copies the block. The
accumulators are float32 whatever the input dtype: rounding each partial into
bf16 and adding in bf16 is how errors grow with the ring size.
"""

from __future__ import annotations

import torch
from torch import Tensor
from cpcompose.precision import accumulation_dtype


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

    def merge(self, rows: slice, block_out: Tensor, block_lse: Tensor) -> None:
        """Fold one block's result for query rows `rows` into the running result."""
        out, lse = self.out[:, :, rows], self.lse[:, :, rows]
        block_lse = block_lse.to(lse.dtype)
        weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)
        out.add_(weight * (block_out.to(out.dtype) - out))
        torch.logaddexp(lse, block_lse, out=lse)
