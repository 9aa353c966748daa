"""cp_shard / cp_unshard / cp_position_ids on real gloo groups."""

from __future__ import annotations

import pytest
import torch

from cpcompose import cp_position_ids, cp_shard, cp_unshard
from cpcompose.layouts import resolve_layout


def shard_unshard_round_trip(mesh, layout: str) -> dict:
    world, rank = mesh.size(), mesh.get_local_rank()
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 8 * world, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 8 * world, 3, generator=g, dtype=torch.float64)
    local = cp_shard(full, mesh, seq_dim=1, layout=layout)
    # A CP-style loss: each rank's loss reads its own tokens; the total is their sum.
    (local * weight.index_select(1, cp_position_ids(8 * world, mesh, layout=layout))).sum().backward()
    shard_grad = full.grad.clone()
    # ROLL's contract: gather, then the same loss on every rank.
    x = local.detach().requires_grad_()
    gathered = cp_unshard(x, mesh, seq_dim=-2, layout=layout)
    (gathered * weight).sum().backward()
    return {"rank": rank, "gathered": gathered.detach(), "full": full.detach(), "shard_grad": shard_grad,
            "unshard_grad": x.grad, "weight": weight}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_round_trip_and_gradients(pools, world: int, layout: str) -> None:
    for r in pools.get(world).run(shard_unshard_round_trip, layout):
        assert torch.equal(r["gathered"], r["full"])
        # d(sum of all ranks' local losses)/d(full) = weight everywhere, after the all-gather.
        assert torch.equal(r["shard_grad"], r["weight"])
        assert torch.equal(r["unshard_grad"], resolve_layout(layout, world).shard(r["weight"], 1, r["rank"]))


def position_ids(mesh) -> list[int]:
    return cp_position_ids(16, mesh, layout="zigzag").tolist()


def test_position_ids(pools) -> None:
    assert pools.get(2).run(position_ids) == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
