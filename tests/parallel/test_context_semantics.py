"""`context_parallel` keeps PyTorch's semantics for a region that only shards and restores buffers.

PyTorch's `torch.distributed.tensor.experimental.context_parallel` lets a region shard
buffers with no module run inside it; its tests check the shard contents, buffers left
sharded on exit (`no_restore_buffers`), and that nothing leaks after exit. A region in
which a model ran without any attention going through CP still raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpcompose import context_parallel
from cpcompose.layouts import ZigzagLayout
from cpcompose.parallel import active_cp_region


def shard_and_restore(mesh) -> dict:
    world, rank = mesh.size(), mesh.get_local_rank()
    x = torch.arange(2 * 8 * world, dtype=torch.float64).view(2, 8 * world)
    y = x.clone() + 1000
    full_x, full_y = x.clone(), y.clone()
    with context_parallel(mesh, buffers=[x, y], buffer_seq_dims=[1, 1], no_restore_buffers={y}):
        inside = {"x": x.clone(), "y": y.clone(), "region": active_cp_region() is not None}
    layout = ZigzagLayout(world)
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    after = F.scaled_dot_product_attention(q, q, q, is_causal=True)  # runs on this process alone again
    return {
        "shard_x": torch.equal(inside["x"], layout.shard(full_x, 1, rank)),
        "shard_y": torch.equal(inside["y"], layout.shard(full_y, 1, rank)),
        "restored_x": torch.equal(x, full_x),
        "y_left_sharded": torch.equal(y, layout.shard(full_y, 1, rank)),
        "region_inside": inside["region"],
        "region_after": active_cp_region() is not None,
        "plain_after": torch.equal(after, F.scaled_dot_product_attention(q, q, q, is_causal=True)),
    }


def test_a_region_that_only_shards_buffers_is_fine(pools) -> None:
    for got in pools.get(2).run(shard_and_restore):
        assert got == {"shard_x": True, "shard_y": True, "restored_x": True, "y_left_sharded": True,
                       "region_inside": True, "region_after": False, "plain_after": True}


def model_without_routed_attention(mesh) -> str:
    x = torch.randn(1, 8 * mesh.size(), 4)
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            torch.nn.Linear(4, 4)(x)  # a module ran; nothing went through CP
        return "no error"
    except ValueError as e:
        return str(e)


def test_a_model_that_routed_no_attention_still_raises(pools) -> None:
    for message in pools.get(2).run(model_without_routed_attention):
        assert "no attention call went through context parallelism" in message
