"""`tiled_mlp` / `apply_tiled_mlp`: the untiled output and gradients, one tile's intermediate at a time.

Reference: the same Llama SwiGLU feed-forward called on the whole sequence, one process. Tolerance: float64,
derived (tests/support/tolerance.py), relative to each tensor's largest entry, on the output and on the
gradients of the input and of every weight. The tiled run does the
same per-token arithmetic (each output row is the same matmul row) and sums weight gradients over tiles
instead of inside one matmul: measured <= 1.3e-14 on values up to ~40 (a few ulps), while a lost tile, a tile
counted twice or a missing parameter gradient is off by >= 1e-2.

Memory: a `TorchDispatchMode` records the largest tensor any op makes during forward and backward; tiled it
is one tile's `batch x tile x ffn_dim` (or a weight, if larger), untiled the whole `batch x seq x ffn_dim`
(the probe can fail).
"""

from __future__ import annotations

import math

import pytest
import torch

from cpcompose.distributed.tiled import apply_tiled_mlp, tiled_mlp
from cpcompose.models import FeedForward
from tests.support.live_storages import LargestMade
from tests.support.tolerance import relative_bound, relative_error

BATCH, SEQ, DIM, FFN = 2, 30, 8, 96
TOL = relative_bound(terms=BATCH * SEQ * FFN)  # derived, float64: a weight gradient sums over tokens x hidden width


def _mlp(seed: int = 0) -> FeedForward:
    torch.manual_seed(seed)
    mlp = FeedForward(dim=DIM, hidden_dim=FFN).double()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return mlp


def _x(requires_grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, DIM, generator=g, dtype=torch.float64).requires_grad_(requires_grad)


def _step(mlp: torch.nn.Module, x: torch.Tensor, call) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Output, and the gradients of a fixed non-uniform function of it."""
    out = call(mlp, x)
    weights = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    got = {"out": out.detach()}
    if x.grad is not None:
        got["x"] = x.grad
    got.update({n: p.grad for n, p in mlp.named_parameters()})
    return got


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert got.keys() == want.keys()
    return {k: relative_error(got[k], want[k]) for k in want}


@pytest.mark.parametrize("tiles", [2, 4, 7, SEQ, SEQ + 5])  # even, ragged, one token a tile, more tiles than tokens
@pytest.mark.parametrize("x_grad", [True, False])  # the weights still get gradients when the input needs none
def test_tiled_equals_untiled_float64(tiles: int, x_grad: bool) -> None:
    want = _step(_mlp(), _x(x_grad), lambda m, x: m(x))
    got = _step(_mlp(), _x(x_grad), lambda m, x: tiled_mlp(m, x, tiles, seq_dim=1))
    worst = _worst(got, want)
    assert max(worst.values()) <= TOL, worst


def test_other_sequence_dims_and_autograd_grad() -> None:
    """seq_dim counts from either end; `torch.autograd.grad` (not only `.backward`) sees the weight gradients."""
    mlp, x = _mlp(), _x()
    xt = x.detach().transpose(0, 1).contiguous().requires_grad_()  # (seq, batch, dim)
    for dim in (0, -3):
        out = tiled_mlp(mlp, xt, 4, seq_dim=dim)
        ref = mlp(xt)
        w = tuple(mlp.parameters())
        got = torch.autograd.grad(out.square().sum(), (xt, *w))
        want = torch.autograd.grad(ref.square().sum(), (xt, *w))
        assert relative_error(out, ref) <= TOL
        assert max(relative_error(a, b) for a, b in zip(got, want)) <= TOL


def test_apply_swaps_the_class_and_keeps_the_names() -> None:
    mlp, plain = _mlp(), _mlp()
    names = [n for n, _ in mlp.named_parameters()]
    apply_tiled_mlp([mlp], tiles=3)
    assert isinstance(mlp, FeedForward) and type(mlp).__name__ == "TiledFeedForward"
    assert [n for n, _ in mlp.named_parameters()] == names
    assert mlp.state_dict().keys() == plain.state_dict().keys()
    worst = _worst(_step(mlp, _x(), lambda m, x: m(x)), _step(plain, _x(), lambda m, x: m(x)))
    assert max(worst.values()) <= TOL, worst
    apply_tiled_mlp([mlp], tiles=5)  # again: changes the count, stays one subclass deep
    assert type(mlp).__bases__[1] is FeedForward and mlp._mlp_tiles == 5
    with pytest.raises(ValueError, match="tiles must be >= 1"):
        apply_tiled_mlp([mlp], tiles=0)
    with pytest.raises(ValueError, match="tiles must be >= 1"):
        tiled_mlp(plain, _x(), 0)


def test_only_one_tile_of_the_intermediate_is_made() -> None:
    tiles = 5
    tile_intermediate = BATCH * math.ceil(SEQ / tiles) * FFN
    for call, bound in ((lambda m, x: tiled_mlp(m, x, tiles), tile_intermediate),
                        (lambda m, x: m(x), BATCH * SEQ * FFN)):
        probe = LargestMade()
        with probe:
            _step(_mlp(), _x(), call)
        assert probe.largest == max(bound, FFN * DIM), (probe.largest, bound)  # (weights are FFN x DIM)
