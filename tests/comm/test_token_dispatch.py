"""comm's token dispatch and combine against one process that runs every row through its own expert.

Every rank builds the same global problem from one seed: each rank's tokens, their
top-k experts, every expert's weight matrix W_e and a probe the loss is weighted by.
The ranks dispatch their rows, each expert multiplies the rows it received by its
W_e (held on its owner only), the results come home and the loss is backpropagated.
One process computes the same loss with every row and every W_e, and the ranks'
outputs, token gradients and W_e gradients must match it.

Tolerance: the derived bound of tests/support/tolerance.py, 4 * eps(float64) * n *
max |reference|, n the longest reduction behind a value (k * width for an output,
k * width_out for a token gradient, the rows routed to an expert for its W_e
gradient). The dispatched rows themselves involve no arithmetic: they must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cpcompose.comm import CommMeter, CPGroup, combine_from_experts, dispatch_to_experts
from tests.support.tolerance import assert_close


@dataclass(frozen=True)
class Routing:
    tokens: tuple[int, ...]  # tokens on each rank (0 allowed)
    num_experts: int
    top_k: int
    silent_rank: int | None = None  # a rank none of whose experts any token chooses
    width: int = 8
    width_out: int = 6
    seed: int = 0


def _problem(routing: Routing, world: int) -> dict:
    """The global problem, identical on every rank and in the test process."""
    g = torch.Generator().manual_seed(routing.seed)
    local = routing.num_experts // world
    chosen = [e for e in range(routing.num_experts) if routing.silent_rank is None or e // local != routing.silent_rank]
    tokens, top, probe = [], [], []
    for count in routing.tokens:
        tokens.append(torch.randn(count, routing.width, generator=g, dtype=torch.float64))
        picks = [torch.randperm(len(chosen), generator=g)[:routing.top_k] for _ in range(count)]
        none = torch.empty(0, routing.top_k, dtype=torch.long)
        top.append(torch.tensor(chosen)[torch.stack(picks)] if count else none)
        probe.append(torch.randn(count, routing.width_out, generator=g, dtype=torch.float64))
    weights = torch.randn(routing.num_experts, routing.width, routing.width_out, generator=g, dtype=torch.float64)
    return {"tokens": tokens, "top": top, "probe": probe, "weights": weights}


def dispatch_case(mesh, routing: Routing) -> dict:
    cp = CPGroup.from_mesh(mesh)
    problem = _problem(routing, cp.world)
    k, local = routing.top_k, routing.num_experts // cp.world
    tokens = problem["tokens"][cp.rank].clone().requires_grad_()
    first = cp.rank * local
    weights = problem["weights"][first:first + local].clone().requires_grad_()  # this rank's experts only
    meter = CommMeter()
    dispatched = dispatch_to_experts(tokens.repeat_interleave(k, 0), problem["top"][cp.rank].reshape(-1),
                                     num_experts=routing.num_experts, group=cp, meter=meter)
    blocks = dispatched.rows.split(dispatched.expert_counts)
    expert_rows = torch.cat([block @ weights[e] for e, block in enumerate(blocks)])
    out = combine_from_experts(expert_rows, dispatched).view(len(tokens), k, routing.width_out).sum(1)
    (out * problem["probe"][cp.rank]).sum().backward()
    return {"rows": dispatched.rows.detach(), "expert_counts": dispatched.expert_counts,
            "first_expert": dispatched.first_expert, "offsets": dispatched.offsets().tolist(),
            "out": out.detach(), "grad_tokens": tokens.grad, "grad_weights": weights.grad}


def _reference(routing: Routing, world: int) -> dict:
    """One process: every row times its expert's W_e, summed over the token's k experts."""
    problem = _problem(routing, world)
    tokens = [t.clone().requires_grad_() for t in problem["tokens"]]
    weights = problem["weights"].clone().requires_grad_()
    outs = [(t.unsqueeze(1).unsqueeze(2) @ weights[top]).squeeze(2).sum(1) for t, top in zip(tokens, problem["top"])]
    sum((o * p).sum() for o, p in zip(outs, problem["probe"])).backward()
    return {"out": [o.detach() for o in outs], "grad_tokens": [t.grad for t in tokens], "grad_weights": weights.grad,
            "rows": [t.detach().repeat_interleave(routing.top_k, 0) for t in tokens],
            "experts": [top.reshape(-1) for top in problem["top"]]}


@pytest.mark.parametrize("world,routing", [
    (2, Routing(tokens=(7, 4), num_experts=6, top_k=2)),
    (4, Routing(tokens=(9, 5, 6, 0), num_experts=8, top_k=1, silent_rank=2, seed=1)),
], ids=["P2-top2-uneven", "P4-silent-rank2-empty-rank3"])
def test_dispatch_compute_combine_matches_one_process(pools, world: int, routing: Routing) -> None:
    got = pools.get(world).run(dispatch_case, routing)
    ref = _reference(routing, world)
    local = routing.num_experts // world
    per_expert = [sum(int((e_of == e).sum()) for e_of in ref["experts"]) for e in range(routing.num_experts)]
    for rank, mine in enumerate(got):
        experts = range(rank * local, (rank + 1) * local)
        # expert-major, then source rank, then the source's row order: exact, no arithmetic
        want_rows = torch.cat([rows[e_of == e] for e in experts for rows, e_of in zip(ref["rows"], ref["experts"])])
        assert torch.equal(mine["rows"], want_rows), f"rank {rank}: dispatched rows"
        assert mine["expert_counts"] == tuple(per_expert[e] for e in experts), f"rank {rank}"
        assert mine["first_expert"] == rank * local
        assert mine["offsets"] == torch.tensor(mine["expert_counts"]).cumsum(0).tolist()
        assert_close(mine["out"], ref["out"][rank], terms=routing.top_k * routing.width, msg=f"rank {rank}: output")
        assert_close(mine["grad_tokens"], ref["grad_tokens"][rank], terms=routing.top_k * routing.width_out,
                     msg=f"rank {rank}: token gradient")
        for e in experts:
            want = ref["grad_weights"][e]
            assert_close(mine["grad_weights"][e - rank * local], want, terms=max(per_expert[e], 1),
                         msg=f"rank {rank}: expert {e}'s weight gradient")
            if per_expert[e] == 0:  # an expert no row reached: zeros, not a missing gradient
                assert torch.equal(mine["grad_weights"][e - rank * local], torch.zeros_like(want))
    if routing.silent_rank is not None:
        silent = got[routing.silent_rank]
        assert silent["rows"].shape == (0, routing.width) and silent["expert_counts"] == (0,) * local
    for rank in (r for r, n in enumerate(routing.tokens) if n == 0):  # sent nothing, still took part
        assert got[rank]["out"].shape == (0, routing.width_out) and got[rank]["grad_tokens"].shape == (0, routing.width)


def meter_case(mesh) -> dict:
    """Rank 0 routes rows to experts [1, 0, 1], rank 1 one row to expert 0 (one expert per rank, float32)."""
    cp = CPGroup.from_mesh(mesh)
    experts = torch.tensor([[1, 0, 1], [0]][cp.rank])
    rows = (torch.arange(len(experts) * 4, dtype=torch.float32).view(-1, 4) + 100 * cp.rank).requires_grad_()
    meter = CommMeter()
    dispatched = dispatch_to_experts(rows, experts, num_experts=2, group=cp, meter=meter)
    back = combine_from_experts(dispatched.rows * 2, dispatched)
    forward = meter.total
    back.sum().backward()
    return {"forward": forward, "backward": meter.total - forward, "ops": set(meter.bytes_sent),
            "exact": torch.equal(back, rows.detach() * 2), "grad": torch.equal(rows.grad, torch.full_like(rows, 2))}


def test_the_meter_counts_counts_rows_and_gradients_sent(pools) -> None:
    rank0, rank1 = pools.get(2).run(meter_case)
    row = 4 * 4  # float32 rows of width 4
    # rank 0: one count (8 B), 2 rows to rank 1, 1 result back to rank 1; the backward mirrors the row exchanges
    assert (rank0["forward"], rank0["backward"]) == (8 + 2 * row + 1 * row, 2 * row + 1 * row)
    assert (rank1["forward"], rank1["backward"]) == (8 + 1 * row + 2 * row, 1 * row + 2 * row)
    for got in (rank0, rank1):
        assert got["ops"] == {"all_to_all"} and got["exact"] and got["grad"]
