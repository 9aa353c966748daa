"""Bytes each strategy sends per rank, against the volume its algorithm implies.

The meter counts what cpcompose hands to torch.distributed (see cpcompose.comm);
these tests pin those volumes so a regression, such as K/V expanded to the query
head count before sending or an extra rotation, fails loudly.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.attention_cases import Case, run_cp
from tests.support.volume_formulas import predicted_bytes

F32 = 4


def kv_shard_bytes(case: Case) -> int:
    """Bytes of this rank's K plus V shard."""
    return 2 * case.batch * case.kv_heads * (case.seq // case.world) * case.head_dim * case.dtype.itemsize


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_sends_what_each_peer_reads(pools, world: int) -> None:
    """Full attention: P-1 whole shards, like a ring rotation. Causal zigzag: half a shard to
    the ranks after this one in the zigzag order (they read only its early chunk)."""
    full = Case("ring", "zigzag", False, 8, 2, world, seq=24 * world)
    causal = Case("ring", "zigzag", True, 8, 2, world, seq=24 * world)
    kv = kv_shard_bytes(full)
    for result in pools.get(world).run(run_cp, full):
        assert result["forward_bytes"] == (world - 1) * kv
        # Backward: K/V move again, and their float32 gradients go back (same bytes for fp32).
        assert result["total_bytes"] == 3 * (world - 1) * kv
    for rank, result in enumerate(pools.get(world).run(run_cp, causal)):
        later, earlier = world - 1 - rank, rank  # peers rank+s that do / do not wrap around
        assert result["forward_bytes"] == later * kv // 2 + earlier * kv
        # Backward: the same K/V again, plus the gradients of the rows this rank received,
        # which mirror the sends: half from the ranks before it, whole from the ones after.
        received = earlier * kv // 2 + later * kv
        assert result["total_bytes"] == 2 * result["forward_bytes"] + received


@pytest.mark.parametrize("world", [2, 4])
def test_allgather_volume(pools, world: int) -> None:
    case = Case("allgather", "zigzag", True, 8, 2, world, seq=24 * world)
    kv = kv_shard_bytes(case)
    for result in pools.get(world).run(run_cp, case):
        assert result["forward_bytes"] == (world - 1) * kv
        # Backward re-gathers K/V, then reduce-scatters float32 dK/dV of the whole sequence.
        assert result["total_bytes"] - result["forward_bytes"] == (world - 1) * kv + (world - 1) * kv


@pytest.mark.parametrize("world", [2, 4])
def test_allgather_sends_only_the_rows_others_read(pools, world: int) -> None:
    """Under a causal sliding window most of a shard is read by nobody else: the all-gather carries the
    rows some peer reads, packed and padded to the most any rank has, both passes and the gradients."""
    from cpcompose.attention.local.blocks import MaskSpec
    from cpcompose.attention.local.plans import gathered_rows, gathered_width
    from cpcompose.layouts import resolve_layout

    case = Case("allgather", "zigzag", True, 8, 2, world, seq=48 * world, window=(9, 0))
    layout = resolve_layout("zigzag", world)
    width = gathered_width(layout, MaskSpec(True, 9, 0), case.seq, world)
    local = case.seq // world
    assert 0 < width < local / 2, (width, local)  # each chunk's last 9 rows, at most, are read across ranks
    assert width == max(sum(r.stop - r.start for r in rows) for rows in gathered_rows(layout, MaskSpec(True, 9, 0), case.seq, world))
    kv = kv_shard_bytes(case) * width // local
    for result in pools.get(world).run(run_cp, case):
        assert result["forward_bytes"] == (world - 1) * kv
        assert result["total_bytes"] - result["forward_bytes"] == (world - 1) * kv + (world - 1) * kv


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_gqa_sends_a_quarter_of_mha(pools, strategy: str) -> None:
    """K/V travel with their own head count: GQA 4:1 moves 1/4 of MHA's bytes."""
    mha = pools.get(3).run(run_cp, Case(strategy, "zigzag", True, 8, 8, 3, seq=72))
    gqa = pools.get(3).run(run_cp, Case(strategy, "zigzag", True, 8, 2, 3, seq=72))
    for m, g in zip(mha, gqa):
        assert 4 * g["total_bytes"] == m["total_bytes"]


def test_alltoall_volume(pools) -> None:
    """Ulysses: (P-1)/P of q, k, v, out (and the float32 LSE) leave each rank."""
    world, case = 4, Case("alltoall", "zigzag", True, 8, 4, 4, seq=96)
    q_bytes = case.batch * case.heads * (case.seq // world) * case.head_dim * F32
    kv = kv_shard_bytes(case)
    lse_bytes = case.batch * case.heads * (case.seq // world) * F32
    expected_forward = (world - 1) * (q_bytes + kv + q_bytes + lse_bytes) // world
    for result in pools.get(world).run(run_cp, case):
        assert result["forward_bytes"] == expected_forward
        # Backward: dO in, dQ/dK/dV out.
        assert result["total_bytes"] - expected_forward == (world - 1) * (2 * q_bytes + kv) // world


def test_alltoall_mqa_replicates_kv_only_where_needed(pools) -> None:
    """One K/V head over 4 ranks: each rank receives it once from each peer, not 4x."""
    world, case = 4, Case("alltoall", "zigzag", True, 8, 1, 4, seq=96)
    q_bytes = case.batch * case.heads * (case.seq // world) * case.head_dim * F32
    kv = kv_shard_bytes(case)  # one head: every rank needs it, so (P-1) copies leave
    lse_bytes = case.batch * case.heads * (case.seq // world) * F32
    expected_forward = (world - 1) * (2 * q_bytes + lse_bytes) // world + (world - 1) * kv
    for result in pools.get(world).run(run_cp, case):
        assert result["forward_bytes"] == expected_forward


# 2-D ("alltoall_ring"): bytes per rank per mesh dimension ("all_to_all" inside a block,
# "p2p" across blocks) equal the closed form `predicted_bytes`, which the cost model uses.
TWOD_VOLUME = [
    Case("alltoall_ring", layout, causal, hq, hkv, world, dtype=dtype, seq=24 * world, alltoall_size=a, v_dim=v_dim)
    for (world, a), layout, causal, (hq, hkv, v_dim), dtype in [
        ((4, 2), "zigzag", True, (8, 2, None), torch.float32),
        ((4, 2), "zigzag", False, (8, 2, None), torch.float32),
        ((4, 2), "contiguous", True, (5, 5, 24), torch.float32),  # uneven heads 3 + 2, Dv != Dqk
        ((4, 2), "zigzag", True, (6, 1, None), torch.bfloat16),  # MQA: the K/V head goes to both members
        ((4, 1), "zigzag", True, (4, 4, None), torch.float32),  # pure ring: no all-to-all bytes
        ((4, 4), "contiguous", False, (4, 2, None), torch.float32),  # pure Ulysses: no ring bytes
        ((2, 1), "zigzag", True, (8, 2, None), torch.float32),
        ((2, 2), "zigzag", True, (8, 2, None), torch.float32),
    ]
]


@pytest.mark.parametrize("case", TWOD_VOLUME, ids=str)
def test_twod_bytes_per_dimension_match_prediction(pools, case: Case) -> None:
    def predicted(rank: int, backward: bool) -> dict[str, int]:
        return predicted_bytes(
            batch=case.batch, heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim, v_dim=case.v_dim,
            local_seq=case.seq // case.world, world=case.world, alltoall_size=case.alltoall_size, rank=rank,
            itemsize=case.dtype.itemsize, causal=case.causal, layout=case.layout, backward=backward,
        )

    for rank, result in enumerate(pools.get(case.world).run(run_cp, case)):
        for got, backward in ((result["forward_by_kind"], False), (result["total_by_kind"], True)):
            want = predicted(rank, backward)
            assert {k: got.get(k, 0) for k in want} == want, f"rank {rank} backward={backward}"
            assert set(got) <= set(want), got  # nothing else moved


def test_twod_gqa_sends_a_quarter_of_mha_on_the_ring(pools) -> None:
    """K/V cross the ring dimension with their own head count, never expanded."""
    mha = pools.get(4).run(run_cp, Case("alltoall_ring", "zigzag", True, 8, 8, 4, seq=96, alltoall_size=2))
    gqa = pools.get(4).run(run_cp, Case("alltoall_ring", "zigzag", True, 8, 2, 4, seq=96, alltoall_size=2))
    for m, g in zip(mha, gqa):
        assert 4 * g["total_by_kind"]["p2p"] == m["total_by_kind"]["p2p"] > 0


def test_twod_planned_bytes_under_windows_and_documents(pools) -> None:
    """With a window or packed documents the ring dimension sends only the rows the planner reads:
    `predicted_bytes` counts them (the planner's rows), and they are fewer than the closed form's dense rows."""
    from cpcompose.layouts import PackedLayout
    from tests.support.packed_cases import PackedCase, run_packed

    window = Case("alltoall_ring", "zigzag", True, 4, 2, 4, seq=192, window=9, alltoall_size=2)
    packed = PackedCase("alltoall_ring", (37, 1, 2, 90, 5, 13, 1, 3, 29), True, None, 4, 2, 4, alltoall_size=2)
    layout: PackedLayout = packed.layout()
    runs = [
        (window, pools.get(4).run(run_cp, window), "zigzag", (9, 0), window.seq // 4),
        (packed, pools.get(4).run(run_packed, packed), layout, None, layout.seq_len // 4),
    ]
    for case, per_rank, spec, win, local in runs:
        for rank, result in enumerate(per_rank):
            shape = dict(batch=case.batch, heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                         local_seq=local, world=4, alltoall_size=2, rank=rank, itemsize=4, causal=True)
            want = predicted_bytes(**shape, layout=spec, window=win)
            assert {k: result["total_by_kind"].get(k, 0) for k in want} == want, f"{case} rank {rank}"
            dense = predicted_bytes(**shape, layout="zigzag")
            assert want["all_to_all"] == dense["all_to_all"] and want["p2p"] < dense["p2p"]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_twod_closed_form_equals_the_planner(layout: str) -> None:
    """The closed form's ring rows are the block planner's, for every rank of larger meshes too (no ranks run)."""
    from cpcompose.layouts import resolve_layout

    for world, a in ((2, 1), (4, 2), (8, 2), (8, 4), (16, 4)):
        for rank in range(world):
            for causal in (True, False):
                shape = dict(batch=1, heads=8, kv_heads=2, head_dim=16, local_seq=8, world=world, alltoall_size=a,
                             rank=rank, itemsize=2, causal=causal)
                assert predicted_bytes(**shape, layout=layout) == predicted_bytes(
                    **shape, layout=resolve_layout(layout, world)
                ), (world, a, rank, causal)


def test_allgather_carries_whole_shards_above_the_planning_limit() -> None:
    """Finding the rows others read plans every pair of ranks; above COMPACT_GATHER_MAX_WORLD every row travels
    (whole shards, plans unchanged), as in Llama 3's all-gather, so a new packed layout never costs P^2 plans."""
    from cpcompose.attention.local import plans as setup
    from cpcompose.attention.local.blocks import MaskSpec
    from cpcompose.layouts import resolve_layout

    mask = MaskSpec(True, 9, 0)
    for world in (setup.COMPACT_GATHER_MAX_WORLD, setup.COMPACT_GATHER_MAX_WORLD + 1):
        layout, seq = resolve_layout("zigzag", world), 64 * world
        width = setup.gathered_width(layout, mask, seq, world)
        if world > setup.COMPACT_GATHER_MAX_WORLD:
            assert width == 64 and all(rows == (slice(0, 64),) for rows in setup.gathered_rows(layout, mask, seq, world))
            assert setup.cached_gathered_plan(layout, mask, seq, 3, 0, world) == setup.cached_plan(layout, mask, seq, 3, 0)
        else:
            assert width < 64 / 2  # a narrow causal window: only chunk edges are read across ranks
