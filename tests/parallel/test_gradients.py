"""`allreduce_gradients` posts its all-reduces in one order on every rank, so its sums are exact.

Ranks are fresh interpreters with different PYTHONHASHSEEDs (tests/support/fresh_ranks.py),
as under torchrun: an order taken from a set of dtypes, or from which gradients a rank
happens to hold, differs between them and pairs a float64 buffer with a float32 one. Every
model mixes float32, float64 and bfloat16 parameters (in each of the six orders) and leaves
some gradients None on one rank only (an expert no token reached) and one on every rank.
Gradients are small integers, exact in every dtype, so the sums must be EXACT (torch.equal):
any wrong pairing is off by far more than a rounding.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from cpcompose import allreduce_gradients
from tests.support.fresh_ranks import run_fresh

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
SHAPES = [(3,), (2, 2), (5,), (1,), (4,), (2, 3)]
CASE = "tests.parallel.test_gradients:exact_sums"


def _value(rank: int, index: int) -> float:
    """Rank `rank`'s gradient entry for parameter `index`: a small integer (exact in bfloat16, and its sums too)."""
    return float(1 + (3 * rank + index) % 7)


def _present(rank: int, index: int, world: int) -> bool:
    """Parameter 5 has no gradient anywhere; parameter i (< 5) is missing on rank i % (world + 1) only."""
    return index != 5 and index % (world + 1) != rank


def _model(order: tuple[torch.dtype, ...]) -> nn.ParameterList:
    """Six parameters whose dtypes cycle through `order`."""
    return nn.ParameterList(nn.Parameter(torch.zeros(s, dtype=order[i % 3])) for i, s in enumerate(SHAPES))


def exact_sums(mesh) -> list[str]:
    """Every dtype order, every parameter: what differs from the exact sum (empty when all are exact)."""
    rank, world = mesh.get_local_rank(), mesh.size()
    wrong = []
    for order in itertools.permutations(DTYPES):
        model = _model(order)
        for i, p in enumerate(model):
            p.grad = torch.full_like(p, _value(rank, i)) if _present(rank, i, world) else None
        allreduce_gradients(model, mesh)
        for i, p in enumerate(model):
            want = sum(_value(r, i) for r in range(world) if _present(r, i, world))
            if not any(_present(r, i, world) for r in range(world)):
                if p.grad is not None:
                    wrong.append(f"{order} param {i}: no rank had a gradient, yet it has one")
            elif p.grad is None or p.grad.dtype != p.dtype or not torch.equal(p.grad, torch.full_like(p, want)):
                wrong.append(f"{order} param {i} ({p.dtype}): {None if p.grad is None else p.grad.tolist()} != {want}")
    return wrong


def test_sums_are_exact_across_hash_seeds_dtypes_and_missing_gradients() -> None:
    """Three fresh groups at once (P = 2, 2, 3), every rank with its own hash seed, six dtype orders in each."""
    groups = [[0, 1], [2, 3], [4, 5, 6]]
    assert run_fresh(CASE, groups) == [[[]] * len(seeds) for seeds in groups]


def different_models(mesh) -> str:
    """Rank 0's model has one parameter more: refused on every rank; then a valid call in the same group."""
    rank = mesh.get_local_rank()
    model = nn.ParameterList(nn.Parameter(torch.zeros(2)) for _ in range(2 + (rank == 0)))
    for p in model:
        p.grad = torch.ones_like(p)
    try:
        allreduce_gradients(model, mesh)
        message = "summed"
    except ValueError as e:
        message = str(e)
    same = nn.ParameterList([nn.Parameter(torch.zeros(2))])
    same[0].grad = torch.full((2,), float(rank + 1))
    allreduce_gradients(same, mesh)
    return message + f" | then {same[0].grad.tolist()}"


def test_ranks_with_different_models_are_refused_on_every_rank(pools) -> None:
    for message in pools.get(2).run(different_models):
        assert "allreduce_gradients" in message and "parameters" in message, message
        assert message.endswith("| then [3.0, 3.0]"), message


def bfloat16_sum(mesh) -> list[float]:
    """Rank 0 holds 1, every other rank 2^-8: each partial sum 1 + 2^-8 rounds back to 1 in bfloat16 (its spacing
    at 1 is 2^-7), while the float32 sum 1 + 3 * 2^-8 rounds once to 1 + 2^-6 (a tie, to even)."""
    p = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.full_like(p, 1.0 if mesh.get_local_rank() == 0 else 2.0**-8)
    allreduce_gradients(nn.ParameterList([p]), mesh)
    return p.grad.float().tolist()


def test_bfloat16_gradients_are_summed_in_float32_and_rounded_once(pools) -> None:
    for got in pools.get(4).run(bfloat16_sum):
        assert got == [1 + 2.0**-6] * 4, got
