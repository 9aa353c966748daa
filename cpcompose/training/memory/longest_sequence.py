"""The longest sequence that fits a memory budget: a search over the lengths the CP layout accepts.

Memory grows with the sequence length (activations, the loss's per-token tensors, CP's K/V buffers), so "fits"
is monotone in it and one bisection finds the longest length that fits. The lengths searched are whole multiples
of one grid unit: the layout's chunk count times `GRANULE` tokens, so that each chunk of each rank is a whole
number of 512-token tiles (what the fused loss, the tiled MLP and the attention kernels cut) and every length
searched is one the config accepts. A search starts from a guess (the memory plan's answer, when a slower judge
such as the rehearsal or a real GPU step confirms it) and walks out from it by doubling, so a good guess costs
few trials.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from cpcompose.config import JobConfig
from cpcompose.layouts import resolve_layout
from cpcompose.training.memory.plan import plan_memory

__all__ = ["GRANULE", "grid_unit", "longest", "plan_fits", "with_length"]

GRANULE = 512
"""Tokens per chunk of the layout, at least: the grid of lengths searched."""


def grid_unit(config: JobConfig) -> int:
    """The step of the lengths searched: the CP layout's chunk count (at least 2) times GRANULE."""
    p = config.parallelism
    chunks = getattr(resolve_layout(p.cp_layout, p.cp), "num_chunks", 2 * p.cp)
    return max(2, chunks) * GRANULE


def with_length(config: JobConfig, seq_len: int) -> JobConfig:
    """`config` with `training.seq_len = seq_len` (validated again, so a length the layout refuses raises)."""
    changed = dataclasses.replace(config, training=dataclasses.replace(config.training, seq_len=seq_len))
    changed.validate()
    return changed


def plan_fits(config: JobConfig, world: int, budget_bytes: int, device_type: str = "cuda") -> Callable[[int], bool]:
    """Whether the memory plan of `config` at a length fits `budget_bytes` per rank of `device_type`."""
    return lambda seq_len: plan_memory(with_length(config, seq_len), world,
                                       device_type=device_type).total <= budget_bytes


def longest(fits: Callable[[int], bool], unit: int, guess: int = 0, *, limit: int = 1 << 40) -> int:
    """The longest multiple of `unit` (at most `limit`) for which `fits` holds, or 0 when one unit does not fit.

    `fits` must be monotone (true up to some length, false beyond). Starts at `guess` (rounded down to the grid,
    at least one unit) and doubles away from it until the answer is bracketed, then bisects: about
    2 log2(distance from the guess / unit) calls.
    """
    if unit <= 0:
        raise ValueError(f"longest: unit must be positive, got {unit}")
    top = max(1, limit // unit)
    n = min(top, max(1, guess // unit))
    step = 1
    if fits(n * unit):
        lo, hi = n, None  # lo fits; hi (when known) does not
        while hi is None:
            if lo == top:
                return top * unit
            nxt = min(top, lo + step)
            if fits(nxt * unit):
                lo, step = nxt, step * 2
            else:
                hi = nxt
    else:
        lo, hi = 0, n
        while lo == 0:
            nxt = max(0, hi - step)
            if nxt == 0:
                break
            if fits(nxt * unit):
                lo = nxt
            else:
                hi, step = nxt, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * unit):
            lo = mid
        else:
            hi = mid
    return lo * unit
