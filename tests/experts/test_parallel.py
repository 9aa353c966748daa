"""`parallel_routed_experts` on 2 ranks equals `routed_experts` on one process with every expert.

4 random SwiGLU experts, 2 choices per token; rank r holds experts [2r, 2r + 2). Rank 0 routes 5 tokens (one
choice past the last expert: routed nowhere), rank 1 none at all (it still joins every exchange, and its
experts get rank 0's rows). Each rank's output and its input's and routing weights' gradients equal the
one-process layer's on its tokens; each expert's weight gradient, on its owner alone, equals the one-process
gradient over both ranks' tokens. In float64 (the loop) and float32 (the grouped GEMM on the received
counts). Tolerance derived (tests/support/tolerance.py): terms = hidden + intermediate (the chained products)
+ the routed pairs (what a weight gradient sums), at the dtype's epsilon.

A bad input on one rank (an index out of range, a block of the wrong size, hidden states of the wrong width)
raises the same ValueError on both ranks before any row moves, from the layer's one agreement per call (one
all-gather, counted).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpcompose.comm import CPGroup
from cpcompose.experts import ExpertWeights, parallel_routed_experts, routed_experts
from tests.support.tolerance import tolerance

E, K, HIDDEN, INTER = 4, 2, 16, 8
TOKENS = (5, 0)  # per rank
TERMS = HIDDEN + INTER + sum(TOKENS) * K


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _inputs(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, generator=g, dtype=torch.float64) * 0.5
    down = torch.randn(E, HIDDEN, INTER, generator=g, dtype=torch.float64) * 0.5
    g.manual_seed(1 + rank)
    n = TOKENS[rank]
    hidden = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else torch.zeros(0, K).long()
    if n:
        index[1, 0] = E  # routed nowhere
    weights = torch.rand(n, K, generator=g, dtype=torch.float64)
    cotangent = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in (gate_up, down, hidden, index, weights,
                                                                       cotangent))


def _run(layer, gate_up, down, hidden, index, weights, cotangent) -> dict:  # noqa: ANN001
    leaves = [t.clone().requires_grad_() for t in (gate_up, down, hidden, weights)]
    out = layer(leaves[2], index, leaves[3], ExpertWeights(leaves[0], leaves[1]))
    out.backward(cotangent)
    return {"out": out.detach(), "dgate_up": leaves[0].grad, "ddown": leaves[1].grad, "dhidden": leaves[2].grad,
            "dweights": leaves[3].grad}


def ranks_case(mesh, dtype: torch.dtype) -> dict:  # noqa: ANN001
    group = CPGroup.from_mesh(mesh)
    gate_up, down, hidden, index, weights, cotangent = _inputs(group.rank, dtype)
    block = slice(2 * group.rank, 2 * group.rank + 2)

    def layer(h, i, w, local):  # noqa: ANN001, ANN202
        return parallel_routed_experts(h, i, w, local, num_experts=E, group=group, activation=_swiglu)

    return _run(layer, gate_up[block], down[block], hidden, index, weights, cotangent)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64-loop", "float32-grouped-mm"])
def test_the_ranks_give_one_process_layer(pools, dtype: torch.dtype) -> None:
    def layer(h, i, w, experts):  # noqa: ANN001, ANN202
        return routed_experts(h, i, w, experts, activation=_swiglu)

    alone = [_run(layer, *_inputs(rank, dtype)) for rank in range(2)]  # each rank's tokens, every expert
    per_rank = pools.get(2).run(ranks_case, dtype)
    for rank, got in enumerate(per_rank):
        for key in ("out", "dhidden", "dweights"):
            want = alone[rank][key]
            torch.testing.assert_close(got[key], want, **tolerance(want, terms=TERMS), msg=f"rank {rank} {key}")
        for key in ("dgate_up", "ddown"):  # the owner's block holds both ranks' tokens
            want = (alone[0][key] + alone[1][key])[2 * rank:2 * rank + 2]
            torch.testing.assert_close(got[key], want, **tolerance(want, terms=TERMS), msg=f"rank {rank} {key}")
    assert per_rank[1]["out"].shape == (0, HIDDEN) and per_rank[1]["dgate_up"].abs().sum() > 0


BAD = {  # rank 1's bad input -> what every rank's message must say
    "negative index": "rank 1: expert indices must lie in [0, 4), got -1..",
    "wrong block": "rank 1: this rank holds 1 experts; 4 experts over 2 EP ranks are 2 each",
    "hidden width": "rank 1: hidden states of width 15 for experts of hidden size 16",
}


def refusal_case(mesh, kind: str) -> dict:  # noqa: ANN001
    """Rank 1 alone passes `kind`; then a valid call in the same group. Counts the agreement's all-gathers."""
    import cpcompose.agreement.agree as agree

    group = CPGroup.from_mesh(mesh)
    gate_up, down, hidden, index, weights, _ = _inputs(0, torch.float64)  # every rank rank 0's tokens
    block = slice(2 * group.rank, 2 * group.rank + 2)
    local = ExpertWeights(gate_up[block], down[block])
    bad_hidden, bad_index, bad_local = hidden, index, local
    if group.rank == 1:
        if kind == "negative index":
            bad_index = index.clone()
            bad_index[0, 0] = -1
        elif kind == "wrong block":
            bad_local = ExpertWeights(gate_up[2:3], down[2:3])
        else:
            bad_hidden = hidden[:, :-1]
    gathers, original = [0], agree.all_gather

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        gathers[0] += 1
        return original(*args, **kwargs)

    agree.all_gather = counted
    try:
        message = None
        try:
            parallel_routed_experts(bad_hidden, bad_index, weights, bad_local, num_experts=E, group=group,
                                    activation=_swiglu)
        except ValueError as e:
            message = str(e)
        gathers[0] = 0
        out = parallel_routed_experts(hidden, index, weights, local, num_experts=E, group=group, activation=_swiglu)
    finally:
        agree.all_gather = original
    return {"message": message, "out": out, "agreements": gathers[0]}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_input_on_one_rank_raises_the_same_error_everywhere(pools, kind: str) -> None:
    """One agreement per call covers the dispatch and the combine: a bad input on one rank raises the same
    ValueError on both before any row moves, and the group then runs a valid call (both ranks route rank 0's
    tokens, so both get the same output) with one all-gather of agreement."""
    got = pools.get(2).run(refusal_case, kind)
    messages = {mine["message"] for mine in got}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and message.startswith("expert-parallel experts: invalid input"), message
    assert BAD[kind] in message, message
    torch.testing.assert_close(got[0]["out"], got[1]["out"], rtol=0, atol=0)
    assert [mine["agreements"] for mine in got] == [1, 1]
