"""A per-row key mask (`key_padding`) exact under every strategy, with every kind of padding.

The batch's rows are padded differently: right padding, left padding, a row whose real
tokens all lie in the first zigzag chunk (so rank 1 holds only its padding), a row with
padding inside, and a row of padding only; zigzag, and once a packed layout whose
documents the key mask combines with. The reference is torch's single-process SDPA
in float64 with the same key mask (combined with causality or a window), which gives 0
for a query that sees no key; CP must match its outputs, LSE (-inf there) and the
gradients of q, k and v.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpcompose import cp_attention, cp_shard, cp_unshard
from cpcompose.layouts import PackedLayout
from tests.support.tolerance import assert_close

H, KV, D, SEQ = 4, 2, 8, 48
REAL = [  # per row: which of the SEQ keys are real
    torch.arange(SEQ) < 37,  # right padding
    torch.arange(SEQ) >= 20,  # left padding
    torch.arange(SEQ) < 9,  # real tokens in zigzag chunk 0 only (P = 2: rank 1 holds padding only)
    (torch.arange(SEQ) < 15) | (torch.arange(SEQ) >= 30),  # inner padding
    torch.zeros(SEQ, dtype=torch.bool),  # padding only
]
B = len(REAL)
DOCS = (7, 20, 21)  # a packed case: three documents per row (48 tokens), each row's padding as above
# Derived (tests/support/tolerance.py), float64: a gradient sums over the batch's keys x head dim.
TOL = dict(terms=B * SEQ * D)


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(B, H, SEQ, D, generator=g, dtype=torch.float64),
        "k": torch.randn(B, KV, SEQ, D, generator=g, dtype=torch.float64),
        "v": torch.randn(B, KV, SEQ, D, generator=g, dtype=torch.float64),
        "dout": torch.randn(B, H, SEQ, D, generator=g, dtype=torch.float64),
    }


def reference(causal: bool, window: tuple[int, int] | None, packed: bool) -> dict[str, torch.Tensor]:
    x = {n: t.clone().requires_grad_(n != "dout") for n, t in _inputs().items()}
    i = torch.arange(SEQ)
    visible = torch.ones(SEQ, SEQ, dtype=torch.bool)
    if packed:
        doc = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))
        visible &= doc[:, None] == doc[None, :]
    if causal:
        visible &= i[:, None] >= i[None, :]
    if window is not None:
        visible &= (i[:, None] - i[None, :] <= window[0]) & (i[None, :] - i[:, None] <= window[1])
    mask = visible[None, None] & torch.stack(REAL)[:, None, None, :]
    out = F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=mask, enable_gqa=True)
    (out * x["dout"]).sum().backward()
    k = x["k"].detach().repeat_interleave(H // KV, dim=1)
    scores = (x["q"].detach() @ k.transpose(-1, -2) / D**0.5).masked_fill(~mask, float("-inf"))
    return {"out": out.detach(), "lse": torch.logsumexp(scores, dim=-1),
            **{f"d{n}": x[n].grad for n in ("q", "k", "v")}}


def cp_run(mesh, strategy: str, causal: bool, window: tuple[int, int] | None, alltoall_size: int | None,
           packed: bool) -> dict[str, torch.Tensor]:
    x = _inputs()
    layout = PackedLayout.build([0, *torch.tensor(DOCS).cumsum(0).tolist()], mesh.size()) if packed else "zigzag"
    local = {n: cp_shard(t, mesh, seq_dim=2, layout=layout).requires_grad_(n != "dout") for n, t in x.items()}
    key_padding = cp_shard(torch.stack(REAL), mesh, seq_dim=1, layout=layout)
    extra = {"alltoall_size": alltoall_size} if alltoall_size else {}
    out, lse = cp_attention(local["q"], local["k"], local["v"], mesh=mesh, is_causal=causal, strategy=strategy,
                            window_size=window, key_padding=key_padding, return_lse=True, layout=layout, **extra)
    (out * local["dout"]).sum().backward()
    full = {n: cp_unshard(t.detach(), mesh, seq_dim=2, layout=layout)
            for n, t in (("out", out), ("dq", local["q"].grad), ("dk", local["k"].grad), ("dv", local["v"].grad))}
    return {**full, "lse": cp_unshard(lse.unsqueeze(-1), mesh, seq_dim=2, layout=layout)[..., 0]}


CASES = [
    (strategy, 2, None, causal, None, False)
    for strategy in ("ring", "allgather", "alltoall") for causal in (False, True)
] + [("ring", 2, None, False, (4, 6), False), ("allgather", 2, None, False, None, True),
     ("alltoall_ring", 4, 2, False, None, False), ("ring", 4, None, True, None, False)]


@pytest.mark.parametrize("strategy,world,alltoall_size,causal,window,packed", CASES,
                         ids=[f"{s}-P{w}-{'causal' if c else 'bidirectional'}-w{win}{'-packed' if p else ''}"
                              for s, w, _, c, win, p in CASES])
def test_key_padding_is_exact(pools, strategy: str, world: int, alltoall_size: int | None, causal: bool,
                              window: tuple[int, int] | None, packed: bool) -> None:
    want = reference(causal, window, packed)
    for rank, got in enumerate(pools.get(world).run(cp_run, strategy, causal, window, alltoall_size, packed)):
        assert torch.isfinite(got["out"]).all() and torch.isfinite(got["dk"]).all(), f"rank {rank}: non-finite"
        for name, value in want.items():
            assert_close(got[name], value, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def bad_key_padding(mesh) -> list[str]:
    """Each on one rank only: a wrong key mask, a key mask where rank 1 has none, one with a softcap, one with
    float16: every rank raises; then a valid call in the same group runs."""
    x = _inputs()
    local = {n: cp_shard(x[n], mesh, seq_dim=2) for n in ("q", "k", "v")}
    key_padding = cp_shard(torch.stack(REAL), mesh, seq_dim=1)
    rank = mesh.get_local_rank()
    half = {n: t.half() if rank == 1 else t for n, t in local.items()}
    messages = []
    for bad, softcap, qkv in ((key_padding[:, :-1] if rank == 1 else key_padding, None, local),
                              (key_padding if rank == 0 else None, None, local),
                              (key_padding if rank == 1 else None, 5.0, local),
                              (key_padding, None, half)):
        try:
            cp_attention(qkv["q"], qkv["k"], qkv["v"], mesh=mesh, key_padding=bad, softcap=softcap)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    out = cp_attention(local["q"], local["k"], local["v"], mesh=mesh, key_padding=key_padding)
    dist.barrier(group=mesh.get_group())
    return [*messages, str(out.shape)]


def test_bad_key_padding_on_one_rank_raises_everywhere(pools) -> None:
    for wrong_shape, one_rank_only, softcap, half, valid in pools.get(2).run(bad_key_padding):
        assert "rank 1: key_padding must be a bool tensor (batch, seq_local) = (5, 24)" in wrong_shape, wrong_shape
        assert "inputs differ between CP ranks (key_padding" in one_rank_only, one_rank_only
        assert "rank 1: key_padding with softcap=5.0 is not supported" in softcap, softcap
        assert "rank 1: key_padding with float16 q/k is not supported" in half, half
        assert valid == str(torch.Size([B, H, SEQ // 2, D]))
