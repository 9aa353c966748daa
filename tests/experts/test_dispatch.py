"""The checked token dispatch: a bad input on one rank raises the same error on every rank, then the group works.

Rank 1 alone gets the bad input; every rank must raise the same ValueError (naming
rank 1 and the problem) before any counts or rows move, and a valid dispatch and
combine in the same group must then run (each row comes back doubled: exact).
"""

from __future__ import annotations

import pytest
import torch

from cpcompose.comm import CPGroup
from cpcompose.experts import combine, dispatch

NUM_EXPERTS, WIDTH = 4, 3
BAD_RANK = 1

BAD = {  # rank 1's bad input (`_bad_input`) -> what every rank's message must say
    "index out of range": "rank 1: expert indices must lie in [0, 4), got 0..4",
    "negative index": "rank 1: expert indices must lie in [0, 4), got -1..3",
    "experts not divisible": "rank 1: num_experts (3) must be divisible by the group's 2 ranks",
    "2-D index": "rank 1: expert_of_row must be a 1-D tensor (one expert per row), got shape (5, 1)",
    "length mismatch": "rank 1: expert_of_row has 4 entries for 5 rows: one expert per row",
    "width differs": "inputs differ between CP ranks (row width)",  # valid on rank 1 alone, not with rank 0
    "combine rows short": "rank 1: expert_rows has 4 rows, but this rank's experts received 5",
}


def _valid(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.arange(5 * WIDTH, dtype=torch.float64).view(5, WIDTH) + 100 * rank
    return rows, torch.tensor([3, 0, 2, 2, 1]) if rank else torch.tensor([0, 1, 1, 3, 2])


def _bad_input(kind: str, rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    rows, experts = _valid(rank)
    if rank != BAD_RANK:
        return rows, experts, NUM_EXPERTS
    bad = {
        "index out of range": (rows, torch.tensor([0, 1, 4, 2, 3]), NUM_EXPERTS),
        "negative index": (rows, torch.tensor([0, -1, 3, 2, 3]), NUM_EXPERTS),
        "experts not divisible": (rows, experts, 3),
        "2-D index": (rows, experts.view(5, 1), NUM_EXPERTS),
        "length mismatch": (rows, experts[:4], NUM_EXPERTS),
        "width differs": (torch.cat([rows, rows[:, :1]], 1), experts, NUM_EXPERTS),
    }
    return bad.get(kind, (rows, experts, NUM_EXPERTS))


def refusal_case(mesh, kind: str) -> dict:
    cp = CPGroup.from_mesh(mesh)
    rows, experts, num_experts = _bad_input(kind, cp.rank)
    message = None
    try:
        dispatched = dispatch(rows, experts, num_experts=num_experts, group=cp)
        results = dispatched.rows * 2
        combine(results[:-1] if kind == "combine rows short" and cp.rank == BAD_RANK else results, dispatched)
    except ValueError as e:
        message = str(e)
    rows, experts = _valid(cp.rank)  # the same group, a valid call
    dispatched = dispatch(rows, experts, num_experts=NUM_EXPERTS, group=cp)
    back = combine(dispatched.rows * 2, dispatched)
    return {"message": message, "works": torch.equal(back, rows * 2)}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_input_on_one_rank_raises_the_same_error_everywhere(pools, kind: str) -> None:
    got = pools.get(2).run(refusal_case, kind)
    messages = {mine["message"] for mine in got}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and BAD[kind] in message, message
    assert message.startswith("token combine:" if kind.startswith("combine") else "token dispatch:"), message
    assert all(mine["works"] for mine in got), "a valid call after the refusal"
