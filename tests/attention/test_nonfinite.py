"""NaN and Inf come out of CP attention where, and as, they come out of single-process SDPA.

A NaN in a query row, or in a key, a NaN or an Inf in a value (early, so most rows see
it, or late, so causal rows before it do not, and SDPA's `0 * inf` makes theirs NaN), and
an Inf in a query, under every strategy, causal and not, at P=2 and 4, on the first call
(the full agreement) and a repeated one (the agreement's flags carry the news). The reference is PyTorch's SDPA on the full
sequence (large enough that its kernel propagates a NaN query row). Finite entries
compare within float32 kernel error (1e-5: the blocks' summation order differs);
NaN and +-Inf must sit at the same places with the same signs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpcompose import cp_attention, cp_shard, cp_unshard

KINDS = ("nan_query", "inf_value", "inf_value_late", "nan_value", "nan_key", "inf_query")


def _inputs(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g) for _ in range(3))
    if kind == "nan_query":
        q[0, 0, 37] = float("nan")
    elif kind == "inf_value":
        v[0, 1, 3, 2] = float("inf")
    elif kind == "inf_value_late":
        v[0, 1, 40, 0] = float("inf")
        v[0, 0, 60, 5] = float("-inf")
    elif kind == "nan_value":
        v[0, 0, 23, 4] = float("nan")
    elif kind == "nan_key":
        k[0, 0, 41, 1] = float("nan")
    elif kind == "inf_query":
        q[0, 1, 50, 0] = float("inf")
    return q, k, v


def run(mesh, kind: str, causal: bool) -> dict:
    q, k, v = _inputs(kind)
    local = [cp_shard(t, mesh, seq_dim=2) for t in (q, k, v)]
    return {
        f"{strategy} call {call}": cp_unshard(cp_attention(*local, mesh=mesh, is_causal=causal, strategy=strategy),
                                              mesh, seq_dim=2)
        for strategy in ("ring", "allgather", "alltoall") for call in (1, 2)
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_values_propagate_like_sdpa(pools, kind: str, causal: bool, world: int) -> None:
    q, k, v = _inputs(kind)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert not torch.isfinite(want).all()  # the case really has non-finite outputs
    for got in pools.get(world).run(run, kind, causal):
        for strategy, out in got.items():
            torch.testing.assert_close(
                out, want, equal_nan=True, atol=1e-5, rtol=1e-5, msg=lambda m: f"{strategy}: {m}"
            )
