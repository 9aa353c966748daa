"""Attention sinks (gpt-oss) exact under every strategy and layout.

A sink is a per-head logit with no value: it joins every row's softmax once. The
reference is an explicit float64 softmax over the visible keys and the sink column;
the CP run's outputs, LSE (which includes the sink) and the gradients of q, k, v and the
sinks (the sinks' summed over ranks, as a replicated parameter's is) must match it to
1e-12 (float64 throughout: only summation order differs).
"""

from __future__ import annotations

import pytest

from cpcompose import cp_attention, cp_shard
from tests.support.sinks_cases import DOCS, H, SEQ, TOL, cp_run, inputs, reference
from tests.support.tolerance import assert_close

CASES = [
    (strategy, world, a, causal, window, docs)
    for strategy, world, a in [("ring", 2, None), ("allgather", 2, None), ("alltoall", 2, None), ("ring", 4, None),
                               ("allgather", 4, None), ("alltoall", 4, None), ("alltoall_ring", 4, 2)]
    for causal, window, docs in [(True, None, None), (False, None, None), (True, 5, None), (True, None, DOCS)]
]


@pytest.mark.parametrize("strategy,world,alltoall_size,causal,window,docs", CASES,
                         ids=[f"{s}-P{w}-{'causal' if c else 'full'}-w{win}-{'packed' if d else 'zigzag'}"
                              for s, w, _, c, win, d in CASES])
def test_sinks_are_exact(pools, strategy: str, world: int, alltoall_size: int | None, causal: bool,
                         window: int | None, docs: tuple[int, ...] | None) -> None:
    want = reference(causal, window, docs)
    for rank, got in enumerate(pools.get(world).run(cp_run, strategy, causal, window, docs, alltoall_size)):
        for name, value in want.items():
            assert_close(got[name], value, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def bad_sinks(mesh) -> str:
    """Sinks of the wrong length on rank 1 only: every rank raises; then a valid call in the same group runs."""
    x = inputs(SEQ)
    local = {n: cp_shard(x[n], mesh, seq_dim=2) for n in ("q", "k", "v")}
    sinks = x["sinks"][: H - 1] if mesh.get_local_rank() == 1 else x["sinks"]
    try:
        cp_attention(local["q"], local["k"], local["v"], mesh=mesh, is_causal=True, sinks=sinks)
        message = "no error"
    except ValueError as e:
        message = str(e)
    cp_attention(local["q"], local["k"], local["v"], mesh=mesh, is_causal=True, sinks=x["sinks"])
    return message


def test_bad_sinks_on_one_rank_raise_everywhere(pools) -> None:
    for message in pools.get(2).run(bad_sinks):
        assert "sinks must be a 1-D tensor of one logit per query head (4)" in message and "rank 1" in message
