"""The decay a run's incoming state has undergone by each token, without subnormal numbers.

A diagonal recurrence's correction multiplies the incoming state's readout by
`exp(cumsum(log_decay))`, which falls towards zero along the run. On the way it passes
through the subnormal range (below `finfo.tiny`, about 1e-38 in float32), and so do the
products it enters in the backward. x86 CPUs compute with subnormal operands in microcode,
tens of times slower: measured on Mamba2's SSD correction at 2,048 tokens per rank, about
70 subnormal rows made its backward 3x slower (15 ms against 5).

So a decay below `sqrt(finfo.tiny)` (2^-63 in float32, 2^-511 in float64) is flushed to
exactly zero: a product of two normal numbers above that bound stays normal. What is
dropped is below 2^-63 (float32) of the state's contribution, whose rounding in the output
is 2^-24 of it or more: invisible unless the output is 2^39 times smaller than that
contribution. CUDA kernels flush subnormals anyway (Triton's `exp` is `.ftz`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["decay_since_start", "flushed_exp"]


def flushed_exp(log_decay: Tensor) -> Tensor:
    """`exp(log_decay)` for a log-decay (<= 0), with values below `sqrt(finfo(dtype).tiny)` exactly zero (see the
    module). The gradient is the plain one where the decay is kept and zero where it is flushed."""
    floor = 0.5 * math.log(torch.finfo(log_decay.dtype).tiny)
    return torch.exp(log_decay.masked_fill(log_decay < floor, -math.inf))


def decay_since_start(log_decay: Tensor, dim: int) -> Tensor:
    """`exp(cumsum(log_decay, dim))`, flushed as `flushed_exp`: each token's decay since the run's start."""
    return flushed_exp(torch.cumsum(log_decay, dim=dim))
