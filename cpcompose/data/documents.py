"""Document lengths for packed sequences."""

from __future__ import annotations

import torch

__all__ = ["long_tailed_lengths"]


def long_tailed_lengths(total: int, seed: int, *, scale: int = 64, alpha: float = 1.2) -> list[int]:
    """Document lengths drawn from a Pareto tail (most short, a few very long), filling `total` tokens.

    What realistic packs look like; the tests and the benchmark measure load balance on them.
    """
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(scale * (1 - torch.rand((), generator=g).item()) ** (-1 / alpha)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]
