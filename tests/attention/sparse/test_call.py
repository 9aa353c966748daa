"""Indexer-selected attention under CP exact against one process, in float64, whichever rows move.

Each query carries a list of global key positions (an indexer's top-k), some of them
later than the query or in another document (a top-k over a row with fewer valid keys
than k picks masked ones too): they must be ignored, as the single process's mask
ignores them. The reference is an explicit float64 softmax over the selected, visible
keys of the whole sequence; outputs and the gradients of q, k, v must match it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpcompose import CommMeter, cp_shard, cp_unshard
from cpcompose.attention.sparse.cost import allgather_sent, selected_sent
from cpcompose.attention.sparse.call import attend_selected
from cpcompose.attention.sparse.selected_rows import selected_rows_plan
from cpcompose.comm import CPGroup
from cpcompose.layouts import PackedLayout, resolve_layout

B, H, KV, D, DV, SEQ, TOPK = 2, 4, 2, 8, 6, 48, 10
DOCS = (7, 1, 22, 3, 15)  # 48 tokens
# float64 results differ from the reference only by summation order over at most SEQ keys:
# a bound of SEQ * eps relative to the largest reference value, with a factor 16 for the
# products feeding each sum (q.k, p.v and their gradients' chains).
TOL = 16 * SEQ * torch.finfo(torch.float64).eps


def _inputs(local_pattern: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = {
        "q": torch.randn(B, H, SEQ, D, generator=g, dtype=torch.float64),
        "k": torch.randn(B, KV, SEQ, D, generator=g, dtype=torch.float64),
        "v": torch.randn(B, KV, SEQ, DV, generator=g, dtype=torch.float64),
        "dout": torch.randn(B, H, SEQ, DV, generator=g, dtype=torch.float64),
    }
    if local_pattern:  # each query picks itself and the TOPK - 1 keys before it: a window, mostly on its own rank
        offsets = torch.arange(TOPK)
        x["indices"] = (torch.arange(SEQ)[:, None] - offsets[None, :]).clamp_min(0).expand(B, SEQ, TOPK).clone()
    else:  # any position, later ones and other documents' included (which must be ignored)
        x["indices"] = torch.randint(0, SEQ, (B, SEQ, TOPK), generator=g)
        x["indices"][..., 0] = torch.arange(SEQ)  # every query reads at least itself, as a top-k always does
    return x


def _visible(docs: tuple[int, ...] | None) -> torch.Tensor:
    i = torch.arange(SEQ)
    ok = i[:, None] >= i[None, :]
    if docs is not None:
        doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
        ok &= doc[:, None] == doc[None, :]
    return ok


def _sinks() -> torch.Tensor:
    return torch.randn(H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def reference(docs: tuple[int, ...] | None, local_pattern: bool = False, sinks: bool = False) -> dict:
    x = {n: t.clone().requires_grad_(n in ("q", "k", "v")) for n, t in _inputs(local_pattern).items()}
    sink = _sinks().requires_grad_()
    selected = torch.zeros(B, SEQ, SEQ, dtype=torch.bool).scatter(2, x["indices"], True)
    k, v = (x[n].repeat_interleave(H // KV, dim=1) for n in ("k", "v"))
    scores = x["q"] @ k.transpose(-1, -2) / D**0.5
    scores = scores.masked_fill(~(selected & _visible(docs)).unsqueeze(1), float("-inf"))
    if sinks:  # one logit per head with no value, in every row's softmax
        scores = torch.cat([scores, sink.view(1, H, 1, 1).expand(B, H, SEQ, 1)], dim=-1)
    out = scores.softmax(dim=-1)[..., :SEQ] @ v
    (out * x["dout"]).sum().backward()
    return {"out": out.detach(), **{f"d{n}": x[n].grad for n in ("q", "k", "v")},
            **({"dsinks": sink.grad} if sinks else {})}


def _layout(docs: tuple[int, ...] | None, world: int) -> PackedLayout | str:
    return PackedLayout.build([0, *torch.tensor(docs).cumsum(0).tolist()], world) if docs else "zigzag"


def cp_run(mesh, rows: str, docs: tuple[int, ...] | None, local_pattern: bool = False, sinks: bool = False) -> dict:
    x = _inputs(local_pattern)
    layout = _layout(docs, mesh.size())
    local = {n: cp_shard(x[n], mesh, seq_dim=2, layout=layout).requires_grad_(n != "dout")
             for n in ("q", "k", "v", "dout")}
    indices = cp_shard(x["indices"], mesh, seq_dim=1, layout=layout)
    meter = CommMeter()
    sink = _sinks().requires_grad_() if sinks else None
    out = attend_selected(local["q"], local["k"], local["v"], indices, mesh=mesh, is_causal=True,
                          options=_options(layout, meter), rows=rows, sinks=sink)
    (out * local["dout"]).sum().backward()
    extra = {}
    if sink is not None:  # this rank's share of a replicated parameter's gradient: summed over the ranks
        dist.all_reduce(dsinks := sink.grad.clone(), group=mesh.get_group())
        extra["dsinks"] = dsinks
    full = {n: cp_unshard(t.detach(), mesh, seq_dim=2, layout=layout)
            for n, t in (("out", out), ("dq", local["q"].grad), ("dk", local["k"].grad), ("dv", local["v"].grad))}
    cp = CPGroup.from_mesh(mesh)
    plan = selected_rows_plan(_readable(indices, layout, cp), resolve_layout(layout, cp.world), SEQ, cp)
    return {**full, **extra, "sent": meter.total, "counts": plan.counts}


def _readable(indices: torch.Tensor, layout: object, cp: CPGroup) -> torch.Tensor:
    from cpcompose.attention.sparse.selection import allowed_keys

    allowed = allowed_keys(resolve_layout(layout, cp.world), cp.rank, SEQ, is_causal=True, device=indices.device)
    ok = allowed.unsqueeze(0).expand(B, -1, -1).gather(2, indices)
    return torch.where(ok, indices, -1)


def _options(layout: object, meter: CommMeter):
    from cpcompose.attention.call.options import CPOptions

    return CPOptions(layout=layout, meter=meter)


def _assert_close(got: dict, want: dict) -> None:
    for name in want:
        scale = want[name].abs().max()
        err = (got[name] - want[name]).abs().max()
        assert err <= TOL * scale, f"{name}: max error {err:.3e} > {TOL * scale:.3e}"


@pytest.mark.parametrize("world,rows,docs", [
    (2, "selected", None), (2, "selected", DOCS), (2, "allgather", DOCS), (2, "auto", None), (4, "selected", DOCS),
])
def test_selected_attention_is_exact(pools, world: int, rows: str, docs: tuple[int, ...] | None) -> None:
    want = reference(docs)
    for got in pools.get(world).run(cp_run, rows, docs):
        _assert_close(got, want)


def test_sinks_join_every_softmax(pools) -> None:
    """Attention sinks (HunYuan V4's): outputs, q/k/v gradients and the sinks' summed gradient."""
    want = reference(DOCS, sinks=True)
    for got in pools.get(2).run(cp_run, "selected", DOCS, False, True):
        _assert_close(got, want)


def test_only_selected_rows_move_and_auto_picks_fewer_bytes(pools) -> None:
    """A window-like selection: the selected rows send what the count table says, fewer than all rows."""
    want = reference(None, local_pattern=True)
    results = pools.get(2).run(cp_run, "auto", None, True)
    row_values, itemsize = KV * (D + DV), 8
    for rank, got in enumerate(results):
        _assert_close(got, want)
        expected = selected_sent(got["counts"], rank, row_values, itemsize)
        assert got["sent"] == expected
        assert expected < allgather_sent(B, SEQ // 2, 2, row_values, itemsize)  # so auto took the selected rows


def refusal(mesh) -> list[str]:
    """Out-of-range indices on rank 1 only: every rank raises; then a valid call runs in the same group."""
    x = _inputs()
    local = {n: cp_shard(x[n], mesh, seq_dim=2) for n in ("q", "k", "v")}
    indices = cp_shard(x["indices"], mesh, seq_dim=1)
    bad = indices.clone()
    if mesh.get_local_rank() == 1:
        bad[0, 0, 0] = SEQ
    messages = []
    try:
        attend_selected(local["q"], local["k"], local["v"], bad, mesh=mesh, is_causal=True)
    except ValueError as e:
        messages.append(str(e))
    out = attend_selected(local["q"], local["k"], local["v"], indices, mesh=mesh, is_causal=True)
    messages.append(str(bool(torch.isfinite(out).all())))
    return messages


def test_bad_indices_on_one_rank_raise_on_every_rank(pools) -> None:
    for messages in pools.get(2).run(refusal):
        assert len(messages) == 2 and "rank 1" in messages[0] and "global key positions" in messages[0]
        assert messages[1] == "True"
