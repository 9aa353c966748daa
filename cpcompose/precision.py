"""The one accumulation-dtype rule: sums of partial results run in at least float32.

Merged attention outputs, LSEs, dQ/dK/dV sums across blocks and ranks, and the
loss are accumulated in `accumulation_dtype(input dtype)`: float32 for bf16/fp16/
fp32 (rounding each partial into bf16 is how errors grow with the ring size), and
float64 for float64 (so float64 references stay float64-exact).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["accumulation_dtype", "accumulator_zeros"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to accumulate partial results of `dtype` in."""
    return torch.promote_types(dtype, torch.float32)


def accumulator_zeros(shape: torch.Size | tuple[int, ...], like: Tensor) -> Tensor:
    """Zeros of `shape` on `like`'s device in `like`'s accumulation dtype."""
    return torch.zeros(shape, dtype=accumulation_dtype(like.dtype), device=like.device)
