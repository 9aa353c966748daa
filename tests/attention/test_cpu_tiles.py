"""Causal blocks tiled for the CPU kernel, the local work split in halves, and the started collectives.

* `cpu_tiles`: a tiled causal block covers exactly its visible pairs, each once,
  and computes the same attention: outputs and gradients of the tiled blocks
  (float64, the CPU kernel, LSE merges) equal one untiled causal call within the derived float64 bound
  (only the summation order differs).
* `split_work`: the two halves are the tasks in order, all of them, of about equal work.
* `start_all_gather` / `start_reduce_scatter` on real gloo groups (the reduce-scatter
  runs as an all-to-all and a sum there): exact sums of integers at P=2 and 3. That
  their waits end at the CP group's timeout when a peer stalls or dies is
  tests/training/loop/test_faults.py's all-gather case.
"""

from __future__ import annotations

import pytest
import torch

from cpcompose.attention.local import cpu_tiles
from cpcompose.attention.local.blocks import NO_WINDOW, BlockTask, split_work
from cpcompose.attention.local.execute import backward_blocks, forward_blocks
from cpcompose.attention.local.kernels import KernelArgs
from cpcompose.attention.local.merge import SoftmaxAccumulator
from tests.support.tolerance import assert_close


def _coverage(tasks, nq: int, nk: int) -> torch.Tensor:
    """How many tasks compute each (query row, key row) pair."""
    count = torch.zeros(nq, nk, dtype=torch.int64)
    for t in tasks:
        count[t.q, t.kv] += t.visible().long()
    return count


@pytest.mark.parametrize("n", [1, 64, 256, 257, 1000, 2048, 2049, 3000])
@pytest.mark.parametrize("window", [NO_WINDOW, 3000])
def test_tiles_cover_each_visible_pair_once(n: int, window: int) -> None:
    task = BlockTask(slice(5, 5 + n), slice(7, 7 + n), "causal", window=window)
    tiles = cpu_tiles.tile_causal(task)
    assert _coverage(tiles, 5 + n, 7 + n).equal(_coverage([task], 5 + n, 7 + n))
    b = cpu_tiles.tile_rows(n)
    assert b == (64 if 256 < n <= 2048 else n)
    assert len(tiles) == (1 if n <= b else 2 * -(-n // b) - 1)
    assert all(t.q.stop - t.q.start <= b for t in tiles)


def test_cpu_tasks_keeps_other_blocks_and_caches_plans() -> None:
    full, band = BlockTask(slice(0, 300), slice(0, 100), "full"), BlockTask(slice(0, 100), slice(0, 100), "band", 0, 5)
    plan = (full, BlockTask(slice(0, 300), slice(0, 300), "causal"), band)
    tiled = cpu_tiles.cpu_tasks(plan)
    assert tiled[0] is full and tiled[-1] is band and len(tiled) == 2 + 9  # 300 rows: 5 tiles of 64, 4 full
    assert cpu_tiles.cpu_tasks(plan) is tiled  # a cached plan (a tuple) is tiled once
    assert cpu_tiles.cpu_tasks(list(plan)) is not tiled


def _attend(tasks, q, k, v, dout):
    kernel = KernelArgs(q.shape[-1] ** -0.5, "cpu_flash")
    acc = SoftmaxAccumulator(q, v.shape[-1])
    forward_blocks(acc, q, k, v, tasks, kernel)
    out, lse = acc.finish()
    grads = tuple(torch.zeros_like(t) for t in (q, k, v))
    backward_blocks(grads, dout, q, k, v, out, lse, tasks, kernel)
    return out, lse, *grads


@pytest.mark.parametrize("n", [257, 333, 2048])
def test_tiled_blocks_compute_the_untiled_attention(n: int, monkeypatch) -> None:
    """float64 GQA: forward_blocks/backward_blocks (which tile on the CPU) against one untiled call."""
    g = torch.Generator().manual_seed(n)
    q, dout = (torch.randn(1, 4, n, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for _ in range(2))
    plan = (BlockTask(slice(0, n), slice(0, n), "causal"),)
    tiled = _attend(plan, q, k, v, dout)
    assert len(cpu_tiles.cpu_tasks(plan)) > 1
    monkeypatch.setattr(cpu_tiles, "cpu_tasks", lambda tasks: tasks)
    untiled = _attend(plan, q, k, v, dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), tiled, untiled):
        assert_close(a, b, terms=b.shape[-2] * b.shape[-1], msg=name)  # derived, float64: a sum over keys x head dim


def test_split_work_halves_in_order() -> None:
    tasks = [BlockTask(slice(i * 10, i * 10 + 10), slice(0, 10 * (i + 1)), "full") for i in range(8)]
    early, late = split_work(tasks)
    assert [*early, *late] == tasks and early and late
    work = [sum(t.flops_weight() for t in part) for part in (early, late)]
    assert abs(work[0] - work[1]) <= max(t.flops_weight() for t in tasks)
    lone = BlockTask(slice(0, 10), slice(0, 10), "causal")
    assert split_work([lone]) == ((lone,), ())
    assert split_work([]) == ((), ())


def _collectives(mesh) -> dict:
    from cpcompose.comm import CPGroup, start_all_gather, start_reduce_scatter

    cp = CPGroup.from_mesh(mesh)
    r, p = cp.rank, cp.world
    gathering = start_all_gather(torch.full((2, 3), float(r)), cp)
    x = torch.arange(p * 4, dtype=torch.float32).view(p, 4) * (r + 1)  # rank r's contribution to slice j
    reducing = start_reduce_scatter(x, cp)
    return {"gathered": gathering.wait(), "reduced": reducing.wait()}


@pytest.mark.parametrize("world", [2, 3])
def test_started_collectives_give_exact_results(pools, world: int) -> None:
    results = pools.get(world).run(_collectives)
    total = sum(range(1, world + 1))
    for rank, res in enumerate(results):
        assert res["gathered"].equal(torch.arange(world, dtype=torch.float32).view(world, 1, 1).expand(world, 2, 3))
        assert res["reduced"].equal(torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float32) * total)
