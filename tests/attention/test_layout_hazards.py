"""The ways a split could silently disagree with itself, each now exact or an error on every rank.

1. A packed split rebuilt inside the attention (`cu_seqlens=` with a window) could
   differ from the one the shards were cut by: attention now takes the layout
   object itself, and `cu_seqlens=` is gone.
2. `cp_shard` and `cp_attention` had different defaults for bidirectional calls.
3. A DTensor made the ordinary way holds contiguous chunks, but a zigzag region
   attended it as zigzag.
4. All-to-all accumulated float64 GQA gradients in float32.

Tolerances: float64 CP against a float64 explicit-softmax reference differ only by
summation order, so the derived float64 bound (`F64`) is far above that noise and far
below a float32 rounding (~1e-7), which is what hazard 4 produced.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import distribute_tensor

from cpcompose import (
    PackedLayout,
    context_parallel,
    cp_attention,
    cp_distribute,
    cp_full_tensor,
    cp_shard,
    cp_shard_packed,
    cp_unshard,
)
from tests.support import attention_cases, packed_cases
from tests.support.attention_cases import Case, place_shards
from tests.support.tolerance import assert_close

DOCS = (28, 54, 17, 18, 21, 36, 28, 54)  # long-tailed: the window-balanced split differs from the plain one
WINDOW = 8
# Derived (tests/support/tolerance.py), float64: a gradient sums over batch x keys x head dim.
F64 = dict(terms=2 * sum(DOCS) * 8)


def _grad_inputs(seq: int, heads: int = 4, kv_heads: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, heads, seq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, seq, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, seq, 8, generator=g, dtype=torch.float64)
    return q, k, v


def _reference(q, k, v, causal: bool) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(group, 1)


# --- 1. the packed split travels with the data ---


def packed_window_attention(mesh, strategy: str) -> dict:
    case = packed_cases.PackedCase(strategy, DOCS, True, WINDOW, 4, 2, mesh.size())
    shard = cp_shard_packed(case.cu_seqlens, mesh, window=WINDOW)  # the window-balanced split
    full = packed_cases.make_inputs(case, shard.layout.seq_len)
    local = {n: t.index_select(2, shard.indices) for n, t in full.items()}
    q, k, v = (local[n].requires_grad_() for n in ("q", "k", "v"))
    out, lse = cp_attention(
        q, k, v, mesh=mesh, is_causal=True, strategy=strategy, layout=shard.layout, window_size=WINDOW,
        return_lse=True,
    )
    out.backward(local["dout"])
    try:
        cp_attention(q, k, v, mesh=mesh, is_causal=True, cu_seqlens=case.cu_seqlens)
        refused = "no error"
    except TypeError as e:
        refused = str(e)
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "layout": shard.layout, "refused": refused}


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
def test_packed_window_split_is_the_one_attended(pools, strategy: str) -> None:
    cu = torch.tensor([0, *DOCS]).cumsum(0).tolist()
    assert PackedLayout.build(cu, 2, window=WINDOW).pieces != PackedLayout.build(cu, 2).pieces
    results = pools.get(2).run(packed_window_attention, strategy)
    assert all("cu_seqlens" in r["refused"] for r in results)
    layout = results[0]["layout"]
    got = {n: t[:, :, : sum(DOCS)] for n, t in place_shards(results, layout, layout.seq_len).items()}
    want = packed_cases.reference(packed_cases.PackedCase(strategy, DOCS, True, WINDOW, 4, 2, 2), torch.float64)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert_close(got[name].double(), want[name], atol=2e-5, rtol=2e-5, msg=name)


# --- 2. one default for sharding and attention ---


def defaults_bidirectional(mesh, strategy: str) -> dict:
    q, k, v = _grad_inputs(8 * mesh.size())
    local = [cp_shard(t, mesh, seq_dim=2) for t in (q, k, v)]  # no layout: the default
    out = cp_attention(*local, mesh=mesh, is_causal=False, strategy=strategy)  # no layout: the same default
    full = cp_unshard(out, mesh, seq_dim=2)
    return {"out": full, "want": _reference(q, k, v, causal=False)}


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
def test_sharding_and_attention_share_the_default(pools, strategy: str) -> None:
    for r in pools.get(4).run(defaults_bidirectional, strategy):
        assert_close(r["out"], r["want"], **F64)


# --- 3. CP DTensors mean what they say ---


def dtensor_in_zigzag_region(mesh) -> dict:
    q, k, v = _grad_inputs(8 * mesh.size())
    found: dict = {}
    with context_parallel(mesh):  # zigzag
        plain = [distribute_tensor(t, mesh, [torch.distributed.tensor.Shard(2)]) for t in (q, k, v)]
        try:
            F.scaled_dot_product_attention(*plain, is_causal=True, enable_gqa=True)
            found["plain"] = "no error"
        except ValueError as e:
            found["plain"] = str(e)
        tagged = [cp_distribute(t, mesh, seq_dim=2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*tagged, is_causal=True, enable_gqa=True)  # same group, still healthy
        found["out"] = cp_full_tensor(out)
    with context_parallel(mesh, layout="contiguous"):  # plain DTensors mean contiguous chunks: exact
        out = F.scaled_dot_product_attention(*plain, is_causal=True, enable_gqa=True)
        found["contiguous"] = out.full_tensor()
        try:
            F.scaled_dot_product_attention(*tagged, is_causal=True, enable_gqa=True)
            found["tag_mismatch"] = "no error"
        except ValueError as e:
            found["tag_mismatch"] = str(e)
    found["want"] = _reference(q, k, v, causal=True)
    return found


def test_dtensors_are_attended_in_their_own_order(pools) -> None:
    for r in pools.get(2).run(dtensor_in_zigzag_region):
        assert "cp_distribute" in r["plain"] and "zigzag" in r["plain"], r["plain"]
        assert "sequence is in the order of split" in r["tag_mismatch"], r["tag_mismatch"]
        assert_close(r["out"], r["want"], **F64)
        assert_close(r["contiguous"], r["want"], **F64)


def dtensor_round_trip(mesh) -> list[bool]:
    x = torch.arange(2 * 47 * 3, dtype=torch.float64).view(2, 47, 3)
    packed = PackedLayout.build([0, 5, 30, 47], mesh.size())
    xp = torch.cat([x, x.new_zeros(2, packed.pad, 3)], 1)
    ok = []
    for layout, t in (("zigzag", x[:, :40]), ("contiguous", x[:, :40]), (packed, xp)):
        d = cp_distribute(t, mesh, seq_dim=1, layout=layout)
        ok.append(torch.equal(cp_full_tensor(d, layout=layout), t))
        ok.append(torch.equal(d.full_tensor(), t.index_select(1, _layout(layout, mesh).rank_major_order(t.shape[1]))))
    return ok


def _layout(spec, mesh):
    from cpcompose import resolve_layout

    return resolve_layout(spec, mesh.size())


def test_cp_distribute_round_trips(pools) -> None:
    for ok in pools.get(4).run(dtensor_round_trip):
        assert all(ok), ok


# --- 4. one accumulation dtype ---


def test_alltoall_accumulates_float64_gqa_gradients_in_float64(pools) -> None:
    # 6 query heads over 2 ranks: rank 0's heads 0-2 read K/V heads 0 and 1 unevenly (local expansion).
    case = Case("alltoall", "zigzag", True, 6, 3, 2, dtype=torch.float64, seq=32)
    got = attention_cases.unshard_results(case, pools.get(2).run(attention_cases.run_cp, case))
    want = attention_cases.reference(case, torch.float64)
    for name in ("out", "dq", "dk", "dv"):
        assert_close(got[name], want[name], **F64, msg=name)
