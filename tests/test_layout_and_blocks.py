"""Single-process checks of the pure pieces: layouts, block plans, the LSE merge, kernels."""

from __future__ import annotations

import pytest
import torch

from cpcompose.attention.blocks import MaskSpec, plan
from cpcompose.attention.kernels import attention_backward, attention_forward
from cpcompose.attention.merge import SoftmaxAccumulator
from cpcompose.layouts import Run, resolve_layout


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


def _covered(q_runs, kv_runs, mask: MaskSpec, nq: int, nk: int) -> torch.Tensor:
    """How often the plan computes each (local query, local key) pair."""
    count = torch.zeros(nq, nk, dtype=torch.int)
    for t in plan(q_runs, kv_runs, mask):
        count[t.q, t.kv] += t.visible().int()
    return count


def _positions(runs) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.cat([torch.arange(r.pos, r.pos + r.length) for r in runs])
    doc = torch.cat([torch.full((r.length,), r.doc) for r in runs])
    return pos, doc


RUN_CASES = {
    "zigzag-early-vs-late": ([Run(0, 3, 3, 0), Run(3, 18, 3, 0)], [Run(0, 0, 3, 0), Run(3, 21, 3, 0)]),
    "zigzag-late-vs-early": ([Run(0, 0, 3, 0), Run(3, 21, 3, 0)], [Run(0, 3, 3, 0), Run(3, 18, 3, 0)]),
    "against-everything": ([Run(0, 6, 3, 0), Run(3, 15, 3, 0)], [Run(0, 0, 24, 0)]),
    "documents": ([Run(0, 2, 5, 0), Run(5, 9, 4, 1), Run(9, 30, 6, 2)],
                  [Run(0, 0, 2, 0), Run(2, 7, 2, 0), Run(4, 13, 4, 1), Run(8, 20, 10, 2), Run(18, 36, 1, 2)]),
}


@pytest.mark.parametrize("name", sorted(RUN_CASES))
@pytest.mark.parametrize("mask", [MaskSpec(True), MaskSpec(False), MaskSpec(True, 4), MaskSpec(True, 700)],
                         ids=["causal", "full", "window4", "window700"])
def test_plan_covers_exactly_the_visible_pairs(name: str, mask: MaskSpec, monkeypatch) -> None:
    import cpcompose.attention.blocks as blocks

    monkeypatch.setattr(blocks, "BAND_TILE", 4)  # exercise tiling on small cases
    q_runs, kv_runs = RUN_CASES[name]
    (qp, qd), (kp, kd) = _positions(q_runs), _positions(kv_runs)
    d = qp[:, None] - kp[None, :]
    want = qd[:, None] == kd[None, :]
    if mask.causal:
        want &= d >= 0
    if mask.window is not None:
        want &= d <= mask.window
    got = _covered(q_runs, kv_runs, mask, len(qp), len(kp))
    assert torch.equal(got, want.int())  # each visible pair exactly once, nothing else


def test_merge_of_halves_equals_whole() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    whole, whole_lse = attention_forward(q, k, v, causal=False, scale=0.3, backend="math")
    acc = SoftmaxAccumulator(q, 8)
    for part in (slice(8, 16), slice(0, 8)):
        out, lse = attention_forward(q, k[:, :, part], v[:, :, part], causal=False, scale=0.3, backend="math")
        acc.merge(slice(0, 16), out, lse)
    torch.testing.assert_close(acc.out, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(acc.lse, whole_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_math_kernel_matches_cpu_flash(causal: bool) -> None:
    """The two CPU kernels agree (float64: both exact to ~1e-12), forward and backward, with GQA."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 20, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 20, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 6, 20, 8, generator=g, dtype=torch.float64)
    results = []
    for backend in ("math", "cpu_flash"):
        out, lse = attention_forward(q, k, v, causal=causal, scale=0.35, backend=backend)
        grads = attention_backward(dout, q, k, v, out, lse, causal=causal, scale=0.35, backend=backend)
        results.append((out, lse, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
