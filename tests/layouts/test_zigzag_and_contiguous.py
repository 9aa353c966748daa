"""The uniform layouts, single process: round trips, zigzag's chunk pairs, and its balance of causal work."""

from __future__ import annotations

import pytest
import torch

from cpcompose.attention.local.blocks import MaskSpec, plan
from cpcompose.layouts import resolve_layout


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["zigzag", "contiguous"])
def test_layout_round_trip(name: str, world: int) -> None:
    layout = resolve_layout(name, world)
    x = torch.arange(8 * world * 3).view(3, 8 * world)
    shards = [layout.shard(x, 1, r) for r in range(world)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard[0], layout.local_indices(r, 8 * world))
    assert torch.equal(layout.to_global_order(torch.cat(shards, 1), 1), x)
    assert torch.equal(layout.to_rank_major(x, 1), torch.cat(shards, 1))


def test_zigzag_chunks() -> None:
    assert [resolve_layout("zigzag", 4).chunk_ids(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert resolve_layout("zigzag", 2).local_indices(1, 8).tolist() == [2, 3, 4, 5]


def _rank_flops(layout, rank: int) -> float:
    n = layout.num_chunks  # one token a chunk: each diagonal block computes 1 pair
    return sum(
        t.flops_weight() for src in range(layout.world)
        for t in plan(layout.runs(rank, n), layout.runs(src, n), MaskSpec(causal=True))
    )


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(world: int) -> None:
    zigzag = [_rank_flops(resolve_layout("zigzag", world), r) for r in range(world)]
    assert max(zigzag) == min(zigzag)
    n = 2 * world
    assert sum(zigzag) == n * (n + 1) / 2  # exactly the causal triangle, nothing masked computed
    contiguous = [_rank_flops(resolve_layout("contiguous", world), r) for r in range(world)]
    # Contiguous: rank r computes r full pairs and its diagonal one: max/mean = P / ((P+1)/2).
    assert max(contiguous) / (sum(contiguous) / world) == pytest.approx(2 * world / (world + 1))
