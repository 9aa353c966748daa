"""Attention sinks (gpt-oss) exact under every strategy and layout.

A sink is a per-head logit with no value: it joins every row's softmax once. The
reference is an explicit float64 softmax over the visible keys and the sink column;
the CP run's outputs, LSE (which includes the sink) and the gradients of q, k, v and the
sinks (the sinks' summed over ranks, as a replicated parameter's is) must match it to
1e-12 (float64 throughout: only summation order differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpcompose import cp_attention, cp_shard, cp_unshard
from cpcompose.layouts import PackedLayout
from tests.support.tolerance import assert_close

B, H, KV, D, SEQ = 2, 4, 2, 8, 48
# Derived (tests/support/tolerance.py), float64: a gradient sums over the batch's keys x head dim.
TOL = dict(terms=B * SEQ * D)
DOCS = (7, 1, 22, 3, 15)  # 48 tokens


def _inputs(seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(B, H, seq, D, generator=g, dtype=torch.float64),
        "k": torch.randn(B, KV, seq, D, generator=g, dtype=torch.float64),
        "v": torch.randn(B, KV, seq, D, generator=g, dtype=torch.float64),
        "sinks": torch.randn(H, generator=g, dtype=torch.float64),
        "dout": torch.randn(B, H, seq, D, generator=g, dtype=torch.float64),
    }


def _visible(seq: int, causal: bool, window: int | None, docs: tuple[int, ...] | None) -> torch.Tensor:
    i = torch.arange(seq)
    ok = torch.ones(seq, seq, dtype=torch.bool)
    if causal:
        ok &= i[:, None] >= i[None, :]
    if window is not None:
        ok &= i[:, None] - i[None, :] <= window
    if docs is not None:
        doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
        ok &= doc[:, None] == doc[None, :]
    return ok


def reference(causal: bool, window: int | None, docs: tuple[int, ...] | None) -> dict[str, torch.Tensor]:
    x = {k: v.clone().requires_grad_(k != "dout") for k, v in _inputs(SEQ).items()}
    k, v = (x[n].repeat_interleave(H // KV, dim=1) for n in ("k", "v"))
    scores = x["q"] @ k.transpose(-1, -2) / D**0.5
    scores = scores.masked_fill(~_visible(SEQ, causal, window, docs), float("-inf"))
    full = torch.cat([scores, x["sinks"].view(1, H, 1, 1).expand(B, H, SEQ, 1)], dim=-1)
    out = full.softmax(dim=-1)[..., :-1] @ v
    (out * x["dout"]).sum().backward()
    return {"out": out.detach(), "lse": torch.logsumexp(full, dim=-1).detach(),
            **{f"d{n}": x[n].grad for n in ("q", "k", "v", "sinks")}}


def cp_run(mesh, strategy: str, causal: bool, window: int | None, docs: tuple[int, ...] | None,
           alltoall_size: int | None) -> dict[str, torch.Tensor]:
    x = _inputs(SEQ)
    layout = PackedLayout.build([0, *torch.tensor(docs).cumsum(0).tolist()], mesh.size()) if docs else "zigzag"
    local = {n: cp_shard(x[n], mesh, seq_dim=2, layout=layout).requires_grad_(n != "dout")
             for n in ("q", "k", "v", "dout")}
    sinks = x["sinks"].clone().requires_grad_()
    extra = {"alltoall_size": alltoall_size} if alltoall_size else {}
    out, lse = cp_attention(local["q"], local["k"], local["v"], mesh=mesh, is_causal=causal, sinks=sinks,
                            strategy=strategy, layout=layout, window_size=window, return_lse=True, **extra)
    (out * local["dout"]).sum().backward()
    dist.all_reduce(dsinks := sinks.grad.clone(), group=mesh.get_group())  # a replicated parameter's gradient
    full = {n: cp_unshard(t.detach(), mesh, seq_dim=2, layout=layout)
            for n, t in (("out", out), ("dq", local["q"].grad), ("dk", local["k"].grad), ("dv", local["v"].grad))}
    return {**full, "lse": cp_unshard(lse.unsqueeze(-1), mesh, seq_dim=2, layout=layout)[..., 0],
            "dsinks": dsinks}


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
    x = _inputs(SEQ)
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
