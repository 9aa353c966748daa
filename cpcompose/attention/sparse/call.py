"""Indexer-selected (sparse top-k) attention under CP: each query reads only the keys it selected.

DeepSeek sparse attention and its kin give every query a list of global key positions
(an indexer's top-k). Dense CP strategies cannot express a per-query key set, and
need not move every row: here each rank fetches only the K/V rows its queries
selected from their owners (`selected_rows`), attends locally over those rows with
each query's own mask (selected, causal, same document), and autograd sends the rows'
gradients back. Where the selections cover most of the sequence, fetching every row
(the all-gather's traffic) sends fewer bytes (no row ids): the choice is made from the
exact count table every rank holds (`sparse.cost.choose`), so all ranks agree.

Every rank checks the call and agrees with the others (`agree_across_ranks`) before
any row moves, so a bad input raises the same ValueError everywhere.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.agreement import Signature, agree_across_ranks
from cpcompose.attention.call.options import CPOptions
from cpcompose.attention.sparse.cost import ALLGATHER, SELECTED, choose
from cpcompose.attention.sparse.selected_rows import RowPlan, all_rows_plan, selected_rows_plan
from cpcompose.attention.sparse.selection import allowed_keys
from cpcompose.comm import CPGroup, fetch_rows
from cpcompose.layouts import Layout, resolve_layout
from cpcompose.precision import accumulation_dtype

__all__ = ["RowChoice", "attend_selected"]

RowChoice = Literal["auto", "selected", "allgather"]


def attend_selected(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, *, mesh: DeviceMesh, is_causal: bool,
    scale: float | None = None, options: CPOptions | None = None, rows: RowChoice | None = None,
    caller_error: str | None = None, sinks: Tensor | None = None,
) -> Tensor:
    """Exact attention of each local query over the global keys it selected.

    Args:
        q, k, v: local shards `(batch, heads, S_local, head_dim)`; K/V may have fewer heads (GQA).
        indices: `(batch, S_local, topk)` global key positions per query (an indexer's top-k);
            positions a query may not read (later, another document) are ignored, as a
            single process's mask ignores them.
        mesh: the 1-D CP mesh. options: layout (and meter) as for `cp_attention`.
        rows: "selected" (fetch only selected rows), "allgather" (every row), "auto"
            (fewer bytes); None: "allgather" if `options.strategy` names it, else "auto".
        caller_error: the caller's complaint, raised on every rank.
        sinks: attention sinks (gpt-oss's, HunYuan V4's): one logit per query head `(heads,)` joining
            every row's softmax with no value. Its gradient is this rank's share (sum it over the CP
            ranks, as every replicated parameter's).

    Returns:
        The local output `(batch, heads, S_local, v_head_dim)`.
    """
    options = options or CPOptions()
    cp = CPGroup.from_mesh(mesh)
    layout: Layout | None = None
    error = caller_error or _input_error(q, k, v, indices) or _sinks_error(sinks, q) or options.error(cp.world)
    if error is None and options.window_size is not None:
        error = "a sliding window with indexer-selected attention is not supported under CP"
    if error is None:
        layout = resolve_layout(options.layout, cp.world)
        error = layout.local_len_error(q.shape[2])
    seq_len = q.shape[2] * cp.world
    if error is None and indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < seq_len):
        error = (f"indices must be global key positions in [0, {seq_len}), got "
                 f"{int(indices.min())}..{int(indices.max())}")
    signature = (Signature().shape("q", q.shape).shape("k", k.shape).shape("v", v.shape)
                 .shape("indices", indices.shape, ndim=3).dtype("dtype", q.dtype).flag("causal", is_causal)
                 .float("scale", scale).flag("sinks", sinks is not None).layout(layout))
    agree_across_ranks(cp, error, signature.fields, what="indexer-selected attention", device=_meta_device(q))
    assert layout is not None
    allowed = allowed_keys(layout, cp.rank, seq_len, is_causal=is_causal, device=q.device)
    picked = indices.long()
    readable = allowed.unsqueeze(0).expand(q.shape[0], -1, -1).gather(2, picked)
    picked = torch.where(readable, picked, -1)
    plan = _row_plan(picked, k, v, layout, seq_len, cp, options, rows or _rows_of(options))
    heads_kv, dk = k.shape[1], k.shape[3]
    local = torch.cat([k.transpose(1, 2).reshape(-1, heads_kv * dk),
                       v.transpose(1, 2).reshape(-1, heads_kv * v.shape[3])], dim=1)
    fetched = fetch_rows(local, plan.route(), cp, options.meter)
    positions = layout.local_indices(cp.rank, seq_len, q.device)
    outs = [
        _attend_row(q[b], local.view(q.shape[0], q.shape[2], -1)[b], positions, fetched, plan, b, seq_len,
                    _dense_mask(picked[b], allowed, seq_len), heads_kv, dk, scale, sinks)
        for b in range(q.shape[0])
    ]
    return torch.stack(outs)


def _rows_of(options: CPOptions) -> RowChoice:
    return "allgather" if options.strategy == ALLGATHER else "auto"


def _row_plan(picked: Tensor, k: Tensor, v: Tensor, layout: Layout, seq_len: int, cp: CPGroup,
              options: CPOptions, rows: RowChoice) -> RowPlan:
    """The exchange: the selected rows, or every remote row where asked for or where it sends fewer bytes."""
    everything = all_rows_plan(picked.shape[0], layout, seq_len, cp, picked.device)
    if rows == ALLGATHER:
        return everything
    plan = selected_rows_plan(picked, layout, seq_len, cp, options.meter)
    if rows == SELECTED:
        return plan
    row_values = k.shape[1] * (k.shape[3] + v.shape[3])
    pick = choose(plan.counts, picked.shape[0], picked.shape[1], row_values, k.element_size())
    return plan if pick == SELECTED else everything


def _dense_mask(picked: Tensor, allowed: Tensor, seq_len: int) -> Tensor:
    """`(S_local, seq_len)` bool: selected and readable (`picked` holds -1 where nothing is read)."""
    mask = torch.zeros(picked.shape[0], seq_len + 1, dtype=torch.bool, device=picked.device)
    mask.scatter_(1, torch.where(picked < 0, seq_len, picked), True)
    return mask[:, :seq_len] & allowed


def _attend_row(q: Tensor, local: Tensor, positions: Tensor, fetched: Tensor, plan: RowPlan, batch: int,
                seq_len: int, mask: Tensor, heads_kv: int, dk: int, scale: float | None,
                sinks: Tensor | None) -> Tensor:
    """One batch row: softmax over its local rows and the rows fetched for it, each query's mask applied."""
    mine = (plan.fetched.to(q.device) // seq_len) == batch
    bank = torch.cat([local, fetched[mine]])  # (U, Hk*dk + Hk*dv)
    bank_pos = torch.cat([positions, plan.fetched.to(q.device)[mine] % seq_len])
    keys = bank[:, : heads_kv * dk].view(-1, heads_kv, dk).transpose(0, 1)
    values = bank[:, heads_kv * dk :].view(bank.shape[0], heads_kv, -1).transpose(0, 1)
    groups = q.shape[0] // heads_kv
    keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
    acc = accumulation_dtype(q.dtype)
    scores = (q.to(acc) @ keys.to(acc).transpose(1, 2)) * (scale if scale is not None else dk ** -0.5)
    scores = scores.masked_fill(~mask[:, bank_pos], torch.finfo(acc).min)
    if sinks is not None:  # a logit with no value: it joins the softmax and is dropped
        column = sinks.to(acc).view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ values.to(acc)).to(q.dtype)


def _input_error(q: Tensor, k: Tensor, v: Tensor, indices: Tensor) -> str | None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return (f"q, k, v must be (batch, heads, seq, head_dim), got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        return f"q, k, v shapes do not fit: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    if indices.ndim != 3 or indices.shape[:2] != (q.shape[0], q.shape[2]) or indices.is_floating_point():
        return (f"indices must be integer (batch, S_local, topk) = ({q.shape[0]}, {q.shape[2]}, k), got "
                f"{indices.dtype} {tuple(indices.shape)}")
    return None


def _sinks_error(sinks: Tensor | None, q: Tensor) -> str | None:
    if sinks is None or (isinstance(sinks, Tensor) and sinks.shape == (q.shape[1],)):
        return None
    return f"sinks must be one logit per query head ({q.shape[1]},), got {getattr(sinks, 'shape', sinks)!r}"


def _meta_device(q: Tensor) -> torch.device:
    return q.device if q.device.type == "cuda" else torch.device("cpu")
