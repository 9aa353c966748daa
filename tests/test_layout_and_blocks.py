"""Single-process checks of the pure pieces: layouts, block plans, the LSE merge, kernels."""

from __future__ import annotations

import pytest
import torch

from cpcompose.attention.blocks import plan_blocks
from cpcompose.attention.kernels import attention_backward, attention_forward
from cpcompose.attention.merge import SoftmaxAccumulator
from cpcompose.layout import SeqLayout


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["zigzag", "contiguous"])
def test_layout_round_trip(name: str, world: int) -> None:
    layout = SeqLayout(name, world)
    x = torch.arange(8 * world * 3).view(3, 8 * world)
    shards = [layout.shard(x, 1, r) for r in range(world)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard[0], layout.local_indices(r, 8 * world))
    assert torch.equal(layout.to_global_order(torch.cat(shards, 1), 1), x)
    assert torch.equal(layout.to_rank_major(x, 1), torch.cat(shards, 1))


def test_zigzag_chunks() -> None:
    assert [SeqLayout("zigzag", 4).chunk_ids(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert SeqLayout("zigzag", 2).local_indices(1, 8).tolist() == [2, 3, 4, 5]


def _rank_flops(layout: SeqLayout, rank: int) -> float:
    return sum(
        t.flops_weight()
        for src in range(layout.world)
        for t in plan_blocks(layout.chunk_ids(rank), layout.chunk_ids(src), 1, causal=True)
    )


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(world: int) -> None:
    zigzag = [_rank_flops(SeqLayout("zigzag", world), r) for r in range(world)]
    assert max(zigzag) == min(zigzag)
    assert sum(zigzag) == (2 * world) ** 2 / 2  # exactly the causal triangle, nothing masked computed
    contiguous = [_rank_flops(SeqLayout("contiguous", world), r) for r in range(world)]
    # Contiguous: rank r computes r full blocks and half a diagonal one, so max/mean = (2P-1)/P.
    assert max(contiguous) / (sum(contiguous) / world) == pytest.approx((2 * world - 1) / world)


def _dense_mask(q_chunks, kv_chunks, c, causal) -> torch.Tensor:
    """Which (query, key) pairs the plan computes, as a dense boolean matrix."""
    mask = torch.zeros(len(q_chunks) * c, len(kv_chunks) * c, dtype=torch.int)
    for t in plan_blocks(q_chunks, kv_chunks, c, causal=causal):
        block = torch.ones(t.q.stop - t.q.start, t.kv.stop - t.kv.start, dtype=torch.int)
        mask[t.q, t.kv] += block.tril() if t.causal else block
    return mask


@pytest.mark.parametrize("q_chunks,kv_chunks", [((1, 6), (0, 7)), ((0, 7), (1, 6)), ((2, 5), range(8)), ((3,), (1,))])
def test_plan_covers_exactly_the_causal_pairs(q_chunks, kv_chunks) -> None:
    c = 3
    q_pos = torch.cat([torch.arange(i * c, (i + 1) * c) for i in q_chunks])
    k_pos = torch.cat([torch.arange(j * c, (j + 1) * c) for j in kv_chunks])
    want = (q_pos[:, None] >= k_pos[None, :]).int()
    assert torch.equal(_dense_mask(q_chunks, kv_chunks, c, True), want)  # each pair exactly once


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
