"""clip_grad_norm on plain (replicated) gradients: no process group needed, exact arithmetic."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cpcompose.training.grad_norm import clip_grad_norm


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
