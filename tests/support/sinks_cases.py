"""Attention sinks (gpt-oss): the inputs, the float64 reference and the CP run, shared by the sinks tests.

The reference is an explicit float64 softmax over the visible keys and the sink column; a CP run returns its
unsharded outputs, LSE and gradients (the sinks' summed over ranks, as a replicated parameter's is).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpcompose import cp_attention, cp_shard, cp_unshard
from cpcompose.layouts import PackedLayout

__all__ = ["B", "D", "DOCS", "H", "KV", "SEQ", "TOL", "cp_run", "inputs", "reference"]

B, H, KV, D, SEQ = 2, 4, 2, 8, 48
# Derived (tests/support/tolerance.py), float64: a gradient sums over the batch's keys x head dim.
TOL = dict(terms=B * SEQ * D)
DOCS = (7, 1, 22, 3, 15)  # 48 tokens


def inputs(seq: int) -> dict[str, torch.Tensor]:
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
    x = {k: v.clone().requires_grad_(k != "dout") for k, v in inputs(SEQ).items()}
    k, v = (x[n].repeat_interleave(H // KV, dim=1) for n in ("k", "v"))
    scores = x["q"] @ k.transpose(-1, -2) / D**0.5
    scores = scores.masked_fill(~_visible(SEQ, causal, window, docs), float("-inf"))
    full = torch.cat([scores, x["sinks"].view(1, H, 1, 1).expand(B, H, SEQ, 1)], dim=-1)
    out = full.softmax(dim=-1)[..., :-1] @ v
    (out * x["dout"]).sum().backward()
    return {"out": out.detach(), "lse": torch.logsumexp(full, dim=-1).detach(),
            **{f"d{n}": x[n].grad for n in ("q", "k", "v", "sinks")}}


def cp_run(mesh, strategy: str, causal: bool, window: int | None, docs: tuple[int, ...] | None,
           alltoall_size: int | None, head_chunks: int = 1) -> dict[str, torch.Tensor]:
    x = inputs(SEQ)
    layout = PackedLayout.build([0, *torch.tensor(docs).cumsum(0).tolist()], mesh.size()) if docs else "zigzag"
    local = {n: cp_shard(x[n], mesh, seq_dim=2, layout=layout).requires_grad_(n != "dout")
             for n in ("q", "k", "v", "dout")}
    sinks = x["sinks"].clone().requires_grad_()
    extra = {"alltoall_size": alltoall_size} if alltoall_size else {}
    if head_chunks != 1:
        extra["head_chunks"] = head_chunks
    out, lse = cp_attention(local["q"], local["k"], local["v"], mesh=mesh, is_causal=causal, sinks=sinks,
                            strategy=strategy, layout=layout, window_size=window, return_lse=True, **extra)
    (out * local["dout"]).sum().backward()
    dist.all_reduce(dsinks := sinks.grad.clone(), group=mesh.get_group())  # a replicated parameter's gradient
    full = {n: cp_unshard(t.detach(), mesh, seq_dim=2, layout=layout)
            for n, t in (("out", out), ("dq", local["q"].grad), ("dk", local["k"].grad), ("dv", local["v"].grad))}
    return {**full, "lse": cp_unshard(lse.unsqueeze(-1), mesh, seq_dim=2, layout=layout)[..., 0],
            "dsinks": dsinks}
