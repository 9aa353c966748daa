"""Conformance of every layout to the `Layout` protocol (single process, pure arithmetic).

Every layout in the registry is picked up automatically, plus packed layouts of
several packs and both balances: a new layout is checked by adding it to `LAYOUTS`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpcompose.layouts import Layout, PackedLayout, resolve_layout
from cpcompose.layouts.grouped import GroupedLayout
from tests.support.layout_cases import CASES, PACKS


@pytest.mark.parametrize("layout,seq_len", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_layout_conforms(layout: Layout, seq_len: int) -> None:
    world = layout.world
    assert layout.split_error(seq_len) is None
    # Runs cover the sequence exactly once, in consecutive local rows, equal shares per rank.
    covered = torch.zeros(seq_len, dtype=torch.int64)
    for rank in range(world):
        runs = layout.runs(rank, seq_len)
        row = 0
        for run in runs:
            assert run.row == row and run.length > 0
            covered[run.pos : run.pos + run.length] += 1
            row += run.length
        assert row == seq_len // world
        assert [r.pos for r in runs] == sorted(r.pos for r in runs)  # local order is global order
        positions = torch.cat([torch.arange(r.pos, r.pos + r.length) for r in runs])
        assert torch.equal(layout.local_indices(rank, seq_len), positions)
    assert torch.equal(covered, torch.ones(seq_len, dtype=torch.int64))
    global_runs = layout.global_runs(seq_len)
    assert sum(r.length for r in global_runs) == seq_len and global_runs[0].pos == 0
    # Shard / unshard permutations are each other's inverses.
    x = torch.arange(seq_len * 3).view(3, seq_len)
    shards = [layout.shard(x, 1, r) for r in range(world)]
    assert torch.equal(layout.to_global_order(torch.cat(shards, 1), 1), x)
    assert torch.equal(layout.to_rank_major(x, 1), torch.cat(shards, 1))
    assert torch.equal(layout.rank_major_order(seq_len), torch.cat(shards, 1)[0])
    # Positions restart at each document (one document: global positions).
    for rank in range(world):
        pos = layout.position_ids(rank, seq_len)
        starts = {r.pos: r.pos - next(g.pos for g in global_runs if g.doc == r.doc) for r in layout.runs(rank, seq_len)}
        runs = layout.runs(rank, seq_len)
        assert [int(pos[r.row]) for r in runs] == [starts[r.pos] for r in runs]
    # Lengths the layout cannot split are refused, locally and globally alike.
    assert layout.split_error(0) is not None
    if world > 1:
        assert layout.split_error(seq_len + 1) is not None
    assert layout.local_len_error(seq_len // world) is None
    assert layout.keeps_global_order == torch.equal(layout.rank_major_order(seq_len), torch.arange(seq_len))


def test_identities_differ_between_splits() -> None:
    codes = {name: layout.identity for name, layout, _ in CASES}
    splits: dict[tuple, str] = {}
    for name, layout, seq_len in CASES:
        split = (layout.world, tuple(tuple(r.pos for r in layout.runs(k, seq_len)) for k in range(layout.world)))
        key = split if not isinstance(layout, PackedLayout) else split + (layout.doc_bounds,)
        if key in splits:  # the same split under two names may share a code, nothing else may
            continue
        splits[key] = name
    distinct = {codes[name] for name in splits.values()}
    assert len(distinct) == len(splits)
    # The window-balanced split of a long-tailed pack is a different split: a different identity.
    cu = PACKS["long-tailed"]
    plain, windowed = PackedLayout.build(cu, 2), PackedLayout.build(cu, 2, window=8)
    assert plain.pieces != windowed.pieces and plain.identity != windowed.identity
    assert plain == PackedLayout.build(cu, 2) and plain.identity == PackedLayout.build(cu, 2).identity


def test_identities_are_stable_across_processes() -> None:
    """Ranks are processes: the code must not depend on Python's per-process hash salt."""
    script = (
        "from tests.support.layout_cases import CASES\n"
        "print(' '.join(str(layout.identity) for _, layout, _ in CASES))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root, check=True)
    assert out.stdout.split() == [str(layout.identity) for _, layout, _ in CASES]


@pytest.mark.parametrize(
    "spec,world,message",
    [
        ("striped", 2, "layout='striped' is unknown"),
        (PackedLayout.build([0, 8], 2), 4, "built for 2 CP ranks"),
        (3, 2, "is unknown"),
    ],
)
def test_resolver_refuses(spec: object, world: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_layout(spec, world)  # type: ignore[arg-type]


def test_default_is_zigzag_everywhere() -> None:
    assert resolve_layout(None, 3) == resolve_layout("zigzag", 3)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"balance": "document"}, "balance='document' is unknown"),
        ({"window": -3}, "non-negative"),
        ({"cu_seqlens": [0.0, 4.0, 8.0]}, "must hold integers"),
        ({"cu_seqlens": torch.tensor([0.0, 8.0])}, "must hold integers"),
        ({"world": 0}, "positive number of CP ranks"),
    ],
)
def test_packed_build_refuses(kwargs: dict, message: str) -> None:
    args = {"cu_seqlens": [0, 4, 8], "world": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        PackedLayout.build(args.pop("cu_seqlens"), args.pop("world"), **args)


@pytest.mark.parametrize("layout,seq_len", [c[1:] for c in CASES if isinstance(c[1], GroupedLayout)],
                         ids=[c[0] for c in CASES if isinstance(c[1], GroupedLayout)])
def test_grouped_block_is_its_members_tokens(layout: GroupedLayout, seq_len: int) -> None:
    """A block holds exactly its members' tokens; the member-order index and its inverse move between the two."""
    for block in range(layout.world):
        members = torch.cat([layout.base.local_indices(m, seq_len) for m in layout.members(block)])
        mine = layout.local_indices(block, seq_len)
        assert torch.equal(members.index_select(0, layout.from_member_order(block, seq_len)), mine)
        assert torch.equal(mine.index_select(0, layout.to_member_order(block, seq_len)), members)
        base_pos = torch.cat([layout.base.position_ids(m, seq_len) for m in layout.members(block)])
        order = layout.from_member_order(block, seq_len)
        assert torch.equal(layout.position_ids(block, seq_len), base_pos.index_select(0, order))
    with pytest.raises(ValueError, match="does not divide"):
        GroupedLayout(layout.base, 3)
