"""Packed documents and sliding windows under CP: exact, balanced, and cheaper to communicate.

Tolerance as in test_parity.py: against a float64 reference that runs
each document on its own (no padding), the CP result's RMS error is at most 2x, and
its max error at most 4x, that of single-process fp32 SDPA run per document.
On CUDA (marked `gpu`) that single process is SDPA on the GPU (the memory-efficient
kernel cpcompose uses for fp32), per document, computed by a worker.
"""

from __future__ import annotations

import itertools
import statistics

import pytest
import torch

from cpcompose.attention.local.blocks import MaskSpec, plan
from cpcompose.data import long_tailed_lengths
from cpcompose.layouts import PackedLayout
from tests.support.packed_cases import PackedCase, reference, run_packed, unshard
from tests.support.tolerance import ULPS

PACKS = {
    "mixed": (37, 1, 2, 90, 5, 13, 1, 3, 29),  # includes docs of length 1 and shorter than P; 181 tokens
    "tiny": (1, 2, 1, 3, 1, 1, 2, 1, 1, 3),  # every document shorter than 2P
    "one": (97,),  # a single document spanning the pack (97 is prime: padding needed)
}
MASKS = [(True, None), (False, None), (True, 5)]
MATRIX = [
    PackedCase(strategy, PACKS[pack], causal, window, hq, hkv, world)
    for world, strategy, pack, (causal, window), (hq, hkv) in itertools.product(
        (2, 3, 4), ("ring", "allgather", "alltoall"), sorted(PACKS), MASKS, [(4, 2), (3, 3)]
    )
]


def assert_exact(case: PackedCase, per_rank: list[dict]) -> None:
    got, exact = unshard(case, per_rank), reference(case, torch.float64)
    baseline = reference(case, torch.float32) if case.device == "cpu" else per_rank[0]["baseline"]
    for name in ("out", "lse", "dq", "dk", "dv"):
        err, base = got[name].double() - exact[name], baseline[name].double() - exact[name]
        rms, base_rms = err.pow(2).mean().sqrt().item(), base.pow(2).mean().sqrt().item()
        floor = ULPS * torch.finfo(torch.float64).eps * exact[name].abs().max().item()  # where fp32 is exact
        assert rms <= 2 * base_rms + floor, f"{case} {name}: RMS error {rms:.3g} vs single-process {base_rms:.3g}"
        assert err.abs().max() <= 4 * base.abs().max() + floor, f"{case} {name}: max error"


@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_packed_matches_per_document_reference(pools, case: PackedCase) -> None:
    assert_exact(case, pools.get(case.world).run(run_packed, case))


# 2-D ("alltoall_ring"): 2 x 2 at P=4 through the matrix (the split balanced over all
# four ranks, the ring over two blocks of two), and the degenerate a = 1, 2 at P=2.
TWOD_MATRIX = [
    PackedCase("alltoall_ring", PACKS[pack], causal, window, hq, hkv, world, alltoall_size=a)
    for (world, a), pack, (causal, window), (hq, hkv) in itertools.product(
        ((4, 2),), sorted(PACKS), MASKS, [(4, 2), (3, 3)]
    )
] + [
    PackedCase("alltoall_ring", PACKS[pack], causal, window, 4, 2, 2, alltoall_size=a)
    for a, pack, (causal, window) in itertools.product((1, 2), ("mixed", "one"), MASKS)
] + [
    PackedCase("alltoall_ring", PACKS["mixed"], False, window, 4, 2, 4, alltoall_size=2)
    for window in ((3, 2), (11, 30))  # two-sided windows across blocks
] + [PackedCase("alltoall_ring", PACKS["mixed"], True, 7, 4, 2, 4, balance="zigzag", alltoall_size=2)]


@pytest.mark.parametrize("case", TWOD_MATRIX, ids=str)
def test_twod_packed_matches_per_document_reference(pools, case: PackedCase) -> None:
    assert_exact(case, pools.get(case.world).run(run_packed, case))


# Bidirectional local attention over packed documents (the split balances causal
# work; it only moves work, never results). (3, 2) is narrower than most pieces,
# (11, 30) reaches across pieces and ranks on both sides.
TWO_SIDED = [
    PackedCase(strategy, PACKS[pack], False, window, 4, 2, world)
    for world, strategy, (pack, window) in itertools.product(
        (2, 4), ("ring", "allgather", "alltoall"),
        [("mixed", (3, 2)), ("tiny", (3, 2)), ("one", (3, 2)), ("mixed", (11, 30))],
    )
]


@pytest.mark.parametrize("case", TWO_SIDED, ids=str)
def test_packed_two_sided_window(pools, case: PackedCase) -> None:
    assert_exact(case, pools.get(case.world).run(run_packed, case))


def test_window_with_plain_zigzag_split_and_long_window(pools) -> None:
    """The same machinery under the plain zigzag split, and a window longer than any document."""
    for case in (PackedCase("ring", PACKS["mixed"], True, 7, 4, 2, 3, balance="zigzag"),
                 PackedCase("allgather", PACKS["mixed"], True, 1000, 4, 2, 2)):
        assert_exact(case, pools.get(case.world).run(run_packed, case))


# On CUDA: every strategy, each pack, causal and bidirectional, GQA, P = 2 and 4, fp32.
CUDA_MATRIX = [
    PackedCase(strategy, PACKS[pack], causal, None, 4, 2, world, device="cuda")
    for world, strategy, pack, causal in itertools.product(
        (2, 4), ("ring", "allgather", "alltoall"), sorted(PACKS), (True, False)
    )
] + [
    PackedCase("alltoall_ring", PACKS[pack], causal, None, 4, 2, 4, device="cuda", alltoall_size=2)
    for pack, causal in itertools.product(sorted(PACKS), (True, False))
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_MATRIX, ids=str)
def test_cuda_packed_matches_per_document_baseline(pools, case: PackedCase) -> None:
    assert_exact(case, pools.get(case.world, "cuda").run(run_packed, case))


def rank_work(layout: PackedLayout, mask: MaskSpec) -> list[float]:
    """Attention pairs each rank computes (its queries against every rank's keys)."""
    return [
        sum(t.flops_weight() for src in range(layout.world) for t in plan(layout.runs(r), layout.runs(src), mask))
        for r in range(layout.world)
    ]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("window", [None, 256])
def test_balanced_split_evens_out_attention_work(world: int, window: int | None) -> None:
    mask = MaskSpec(True, window)
    for seed in range(3):
        docs = long_tailed_lengths(16384, seed)
        cu = torch.tensor([0, *docs]).cumsum(0).tolist()
        layout = PackedLayout.build(cu, world, window=window)
        balanced = rank_work(layout, mask)
        assert max(balanced) / statistics.mean(balanced) <= 1.05
        assert {sum(n for _, n, _ in p) for p in layout.pieces} == {layout.seq_len // world}  # equal tokens
        assert layout.pad < world  # the pack, not each document, is padded


def test_window_makes_the_ring_send_less(pools) -> None:
    docs = (300,)
    wide = pools.get(3).run(run_packed, PackedCase("ring", docs, True, None, 4, 2, 3))
    narrow = pools.get(3).run(run_packed, PackedCase("ring", docs, True, 8, 4, 2, 3))
    for w, n in zip(wide, narrow):
        assert n["total_bytes"] < w["total_bytes"] / 3  # a halo of ~8 rows per chunk, not whole shards


def test_two_sided_window_makes_the_ring_send_a_halo(pools) -> None:
    """A two-sided window exchanges a halo on both sides: a few rows per chunk edge, not whole shards."""
    docs = (300,)
    wide = pools.get(3).run(run_packed, PackedCase("ring", docs, False, None, 4, 2, 3))
    narrow = pools.get(3).run(run_packed, PackedCase("ring", docs, False, (8, 8), 4, 2, 3))
    for w, n in zip(wide, narrow):
        assert 0 < n["forward_bytes"] < w["forward_bytes"] / 3


def test_documents_make_the_ring_send_less(pools) -> None:
    """Ranks exchange only the pieces of documents they share: short documents stay mostly local."""
    one = pools.get(2).run(run_packed, PackedCase("ring", (400,), True, None, 4, 2, 2, balance="zigzag"))
    many = pools.get(2).run(run_packed, PackedCase("ring", (50,) * 8, True, None, 4, 2, 2, balance="zigzag"))
    for a, b in zip(one, many):
        assert b["total_bytes"] < a["total_bytes"]


@pytest.mark.parametrize("causal", [True, False])
def test_documents_make_the_allgather_send_less(pools, causal: bool) -> None:
    """All-gather carries only the rows another rank reads, padded to the widest rank's: on a long-tailed pack a
    causal rank's late pieces are read by nobody else, and when every document lies within one rank nothing is
    gathered at all. Exact in every case."""
    from cpcompose.attention.local.blocks import MaskSpec
    from cpcompose.attention.local.call_setup import gathered_width
    from cpcompose.data import long_tailed_lengths

    pack = PackedCase("allgather", tuple(long_tailed_lengths(2048, 0)), causal, None, 4, 2, 2)  # 17 documents
    apart = PackedCase("allgather", (100,) * 4, causal, None, 4, 2, 2, balance="zigzag")  # one zigzag chunk each
    results = {c: pools.get(2).run(run_packed, c) for c in (pack, apart)}
    for c, per_rank in results.items():
        assert_exact(c, per_rank)
    layout = pack.layout()
    width, local = gathered_width(layout, MaskSpec(causal), layout.seq_len, 2), layout.seq_len // 2
    assert width < 0.9 * local if causal else width <= local, (width, local)
    row = pack.batch * pack.kv_heads * 2 * pack.head_dim * 4  # K and V of one row, float32
    for a, c in zip(results[pack], results[apart]):
        assert a["total_bytes"] == width * row * 3  # K/V forward, again backward, float32 dK/dV (P - 1 = 1)
        assert c["total_bytes"] == 0


def test_documents_make_the_twod_ring_send_less(pools) -> None:
    """Across blocks too, only pieces of shared documents travel: with one document per zigzag chunk,
    no document spans two blocks and the ring dimension sends nothing; the all-to-all is unchanged."""
    def case(docs: tuple[int, ...]) -> PackedCase:
        return PackedCase("alltoall_ring", docs, True, None, 4, 2, 4, balance="zigzag", alltoall_size=2)

    one, many = pools.get(4).run(run_packed, case((400,))), pools.get(4).run(run_packed, case((50,) * 8))
    for a, b in zip(one, many):
        assert b["total_by_kind"]["all_to_all"] == a["total_by_kind"]["all_to_all"] > 0  # same shapes
        assert a["total_by_kind"]["p2p"] > 0 and b["total_by_kind"].get("p2p", 0) == 0


def bad_packed(mesh, case: str) -> str:
    from cpcompose import cp_attention

    q = torch.randn(1, 2, 8, 4)
    kwargs: dict = {"mesh": mesh, "is_causal": True}
    try:
        if case == "not_zero":
            kwargs["layout"] = PackedLayout.build([1, 16], 2)
        elif case == "not_increasing":
            kwargs["layout"] = PackedLayout.build([0, 9, 9, 16], 2)
        elif case == "wrong_end":
            kwargs["layout"] = PackedLayout.build([0, 5, 12], 2)
        elif case == "differs_between_ranks":
            kwargs["layout"] = PackedLayout.build([0, 5, 16] if mesh.get_local_rank() == 0 else [0, 6, 16], 2)
        elif case == "window_zero":
            kwargs["window_size"] = 0
        elif case == "window_bidirectional":
            kwargs.update(window_size=4, is_causal=False)
        cp_attention(q, q, q, **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "case,message",
    [
        ("not_zero", "must start at 0"),
        ("not_increasing", "strictly increasing"),
        ("wrong_end", "does not match the packed layout"),
        ("differs_between_ranks", "differ between CP ranks (layout)"),
        ("window_zero", "positive number"),
        ("window_bidirectional", "needs is_causal=True"),
    ],
)
def test_bad_packed_input(pools, case: str, message: str) -> None:
    for got in pools.get(2).run(bad_packed, case):
        assert message in got, got
