"""clip_grad_norm on plain (replicated) gradients (exact arithmetic, no group), and on sharded ones
whose gradient is None on one rank only (every rank must still join the same all-reduces)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cpcompose.training.loop.grad_norm import clip_grad_norm


def _params() -> list[nn.Parameter]:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # global norm 5
    return [a, b]


@pytest.mark.parametrize("max_norm", [0.0, -1.0, 10.0])
def test_non_positive_or_large_max_norm_leaves_gradients(max_norm: float) -> None:
    """training.max_norm <= 0 disables clipping (as --help says), it must not zero or flip gradients."""
    params = _params()
    assert clip_grad_norm(params, max_norm) == pytest.approx(5.0)
    assert params[0].grad.tolist() == [3.0, 0.0] and params[1].grad.tolist() == [4.0]


def test_small_max_norm_scales_to_it() -> None:
    params = _params()
    clip_grad_norm(params, 1.0)
    norm = torch.cat([p.grad for p in params]).norm().item()
    assert norm == pytest.approx(1.0, rel=1e-5)




def sharded_with_a_missing_gradient(mesh) -> float:
    """A DTensor parameter, Shard(0) over the 2 ranks, with no gradient on rank 1 (no token reached it there; its
    shard holds 1 on rank 0), and a plain replicated one holding 3 on every rank: norm sqrt(1 + 9)."""
    from torch.distributed.tensor import DTensor, Shard

    def sharded(value: float) -> DTensor:
        return DTensor.from_local(torch.full((1,), value), mesh, [Shard(0)], run_check=False)

    params = [nn.Parameter(sharded(0.0)), nn.Parameter(torch.zeros(1))]
    if mesh.get_local_rank() == 0:
        params[0].grad = sharded(1.0)
    params[1].grad = torch.full((1,), 3.0)
    return clip_grad_norm(params, 0.0)


def test_a_gradient_missing_on_one_rank_joins_the_same_reductions(pools) -> None:
    """Rank 1 holds no gradient on the sharded parameter: it must still reduce over its mesh (rank 0 would wait
    for it otherwise); small integers, so the float32 sum of squares is exact."""
    assert pools.get(2).run(sharded_with_a_missing_gradient) == [torch.tensor(10.0).sqrt().item()] * 2  # float32
