"""Causal blocks as row tiles, for PyTorch's CPU attention kernel.

The CPU flash kernel skips masked work only in whole tiles of up to 512 keys, so a
causal block of n ≤ 512 rows costs exactly as much as a full n x n block: twice
its visible pairs (measured fwd+bwd, H=8, D=64, fp32: 184 vs 92 ns per visible
pair at n=512; 134 vs 89 at 1024; 99 vs 92 at 8192). Packed batches are made of
such blocks: every short document is one, and every piece of a long one.

Here a causal block runs as diagonal causal tiles of 64 rows, each followed by one
full block on all the keys before it: exactly the same visible pairs, with at most
64²/2 of them wasted per tile instead of up to n²/2. Each tile's rows get two
partial results, merged through their LSE like any other blocks. The rule (tile
blocks of 257-2048 rows; smaller ones gain nothing reliable from the extra calls
and merges, larger ones lose: thin full blocks over thousands of keys run slower)
comes from `scripts/benchmarks/bench_causal_tiles.py` (README): fwd+bwd of one causal block
21-32% faster at 384-1024 rows, 11% at 1536-2048; at 4096 rows tiles of 64-256 are
0-3% slower and at 8192 rows 9-31% slower, so those stay whole.

Only the CPU kernel needs this: the CUDA kernels skip masked work at a fine grain,
and the plans themselves (what every strategy sends and computes) stay the same.
"""

from __future__ import annotations

from typing import Sequence

from cpcompose.attention.local.blocks import BlockTask
from cpcompose.attention.local.plan_memo import PlanMemo

__all__ = ["TILE", "TILED_UP_TO", "WHOLE_UP_TO", "cpu_tasks", "tile_causal", "tile_rows"]


WHOLE_UP_TO = 256  # causal blocks of at most this many rows run as one call
TILED_UP_TO = 2048  # ... and so do blocks of more rows than this
TILE = 64  # rows per diagonal tile


def tile_rows(rows: int) -> int:
    """Rows per diagonal tile for a causal block of `rows` rows (the measured rule above; `rows`: whole)."""
    return TILE if WHOLE_UP_TO < rows <= TILED_UP_TO else rows


def tile_causal(task: BlockTask, rows: int | None = None) -> list[BlockTask]:
    """One causal block as diagonal causal tiles of `rows` rows (default: the rule) and the full blocks left of them.

    A block of at most that many rows comes back as it is. A causal block's window,
    if any, spans the whole block, so every key left of a tile is visible to all its
    rows: those blocks are full.
    """
    q0, n, k0 = task.q.start, task.q.stop - task.q.start, task.kv.start
    b = rows or tile_rows(n)
    if n <= b:
        return [task]
    tiles: list[BlockTask] = []
    for a in range(0, n, b):
        e = min(a + b, n)
        tiles.append(BlockTask(slice(q0 + a, q0 + e), slice(k0 + a, k0 + e), "causal", window=task.window))
        if a:
            tiles.append(BlockTask(slice(q0 + a, q0 + e), slice(k0, k0 + a), "full"))
    return tiles


def cpu_tasks(tasks: Sequence[BlockTask]) -> Sequence[BlockTask]:
    """`tasks` with every causal block tiled; computed once per cached plan (`PlanMemo`)."""

    def build() -> tuple[BlockTask, ...]:
        return tuple(t for task in tasks for t in (tile_causal(task) if task.kind == "causal" else (task,)))

    return _TILED.get(tasks, None, build)


_TILED = PlanMemo()
