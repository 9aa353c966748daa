"""Exact causal depthwise convolution over a CP-sharded sequence.

Mamba-style blocks mix each channel over its last `width` tokens. On a shard the
first width-1 outputs of every run would read tokens held elsewhere (under zigzag
each of a rank's two chunks has its own predecessor; in a pack a predecessor may
span several ranks or be local), so each run gets the width-1 positions before it,
same document only, in one exchange (`cpcompose.comm.row_fetch.post_fetch`), posted before the outputs
that read no halo (all but each run's first width-1) are computed, so it travels
behind them; a document start gets zeros, as if the convolution restarted there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.agreement import CallSpec
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.comm.row_fetch import PostedFetch, assemble_rows, post_fetch, post_gradients_home
from cpcompose.layouts import Layout, LayoutSpec, Run
from cpcompose.mixers._checks import agreed, float_tensors_error, layout_fields, local_layout, shape_of

__all__ = ["ACTIVATIONS", "cp_causal_conv1d", "halo_positions"]

Activation = Literal["silu"]
ACTIVATIONS: tuple[str | None, ...] = (None, "silu")


def halo_positions(layout: Layout, seq_len: int, halo: int) -> list[list[list[int]]]:
    """For each rank and each of its runs, the up to `halo` global positions before the run in its document."""
    starts = {run.doc: run.pos for run in layout.global_runs(seq_len)}
    return [
        [list(range(max(starts[run.doc], run.pos - halo), run.pos)) for run in layout.runs(rank, seq_len)]
        for rank in range(layout.world)
    ]


def _conv_error(x: Tensor, weight: Tensor, bias: Tensor | None, activation: object) -> str | None:
    error = float_tensors_error(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    if error:
        return error
    if x.ndim != 3:
        return f"x must be (batch, seq_local, channels), got shape {tuple(x.shape)}"
    channels = x.shape[2]
    if not (weight.ndim == 2 or (weight.ndim == 3 and weight.shape[1] == 1)) or weight.shape[0] != channels:
        return (f"weight must be a depthwise kernel ({channels}, width) or ({channels}, 1, width) for "
                f"{channels} channels, got shape {tuple(weight.shape)}")
    if weight.shape[-1] < 1:
        return "weight must have width >= 1"
    if bias is not None and tuple(bias.shape) != (channels,):
        return f"bias must be ({channels},), got shape {tuple(bias.shape)}"
    if activation not in ACTIVATIONS:
        return f"activation={activation!r} is unknown; choose one of {ACTIVATIONS}"
    return None


def cp_causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, mesh: DeviceMesh, layout: LayoutSpec = None,
    activation: Activation | None = None, meter: CommMeter | None = None, caller_error: str | None = None,
) -> Tensor:
    """A causal depthwise conv over the global sequence, restarting at each document, on this rank's shard.

    `out[t] = act(bias + sum_k weight[:, k] * x[t - width + 1 + k])` over positions of
    t's document (zero before its start), as `nn.Conv1d(groups=channels,
    padding=width-1)` truncated to the sequence, per document.

    Args:
        x: this rank's shard `(batch, seq_local, channels)`, cut by `layout`.
        weight: `(channels, width)` or `(channels, 1, width)` (as `nn.Conv1d` stores it).
        bias: `(channels,)` or None.
        mesh: the 1-D CP mesh.
        layout: "zigzag" (default), "contiguous", or a `Layout` such as a `PackedLayout`.
        activation: None, or "silu" after the conv (what Mamba does).
        meter: counts the halo bytes sent (forward rows and backward gradients).
        caller_error: the caller's own complaint about this call, raised on every rank.

    Returns:
        `(batch, seq_local, channels)`, differentiable w.r.t. `x`, `weight` and `bias`.

    Raises:
        ValueError: on every rank, if any rank's input is invalid or the ranks' inputs differ.
    """
    cp = CPGroup.from_mesh(mesh)
    seq_local = x.shape[1] if isinstance(x, Tensor) and x.ndim == 3 else 0
    split, error = local_layout(layout, cp, seq_local)
    error = caller_error or error or _conv_error(x, weight, bias, activation)
    grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (x, weight, bias))
    signature = layout_fields(split, getattr(x, "dtype", None), grad, ("x", shape_of(x)), ("weight", shape_of(weight)))
    signature += [("bias", int(bias is not None)), ("activation", ACTIVATIONS.index(activation)
                                                     if activation in ACTIVATIONS else -1)]
    device = x.device if isinstance(x, Tensor) else torch.device("cpu")

    def run() -> Tensor:
        assert split is not None
        return _causal_conv(x, weight.reshape(weight.shape[0], weight.shape[-1]), bias, cp, split, activation, meter)

    def spec() -> CallSpec:  # what a rank that deviates from this call later replays on zeros
        assert split is not None
        return CallSpec((x.shape,), x.dtype, x.device, functools.partial(_replay_halo, split, weight.shape[-1] - 1))

    return agreed(cp, error, signature, what="cp_causal_conv1d", cached_as="cp_causal_conv1d", device=device,
                  spec=spec, run=run)


def _replay_halo(layout: Layout, halo: int, cp: CPGroup, x: Tensor) -> None:
    """The conv's one forward collective, the halo exchange, on zeros shaped like the call's `x`."""
    _post_halo(x, layout, halo, cp, None)[0].received()


def _post_halo(x: Tensor, layout: Layout, halo: int, cp: CPGroup, meter: CommMeter | None
               ) -> tuple[PostedFetch, list[list[int]]]:
    """Post the exchange of every run's `halo` positions before it (same document); also this rank's, per run."""
    seq_len = x.shape[1] * cp.world
    wanted = halo_positions(layout, seq_len, halo)
    posted = post_fetch(x, [sum(w, []) for w in wanted], cp=cp, layout=layout, seq_len=seq_len, meter=meter)
    return posted, wanted[cp.rank]


def _causal_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, cp: CPGroup, layout: Layout, activation: str | None,
    meter: CommMeter | None,
) -> Tensor:
    """The conv on checked inputs: the halo exchange posted, then `_HaloConv`, then the activation."""
    halo = weight.shape[1] - 1
    posted, before = _post_halo(x, layout, halo, cp, meter)
    edges = _edges(layout.runs(cp.rank, x.shape[1] * cp.world), before, halo, x.device)
    out = _HaloConv.apply(x, weight.unsqueeze(1), bias, posted, edges)
    return (F.silu(out) if activation == "silu" else out).transpose(1, 2)


@dataclass(frozen=True)
class _Edges:
    """The output rows one conv over the shard gets wrong, and the small table that gets them right.

    One conv over the whole shard (zero padding before row 0) is right for every row whose
    `halo` rows before it in its document are the shard's rows before it. The first rows of a
    run are not, unless the run continues the local run before it in rows and document: their
    history is elsewhere (another rank, another local run) or zero (a document start). For
    those runs the table holds, per run, a segment of `2 * halo` columns: its true history
    (`halo` columns: zeros before its document's start, then fetched rows), then its first
    `count` rows (then zeros): a conv over the table without padding gives the segment's `count`
    right outputs at its start.
    """

    out_rows: Tensor  # the shard's rows to replace (channels-first columns), in table-output order
    picks: Tensor  # their columns in the conv-over-the-table output
    pool_index: Tensor  # per table column, its row of [a zero row, the fetched rows, `firsts`' rows]
    firsts: Tensor  # the local first rows the table reads, in column order
    own_columns: Tensor  # the columns that read `firsts` (index lists, not masks: fake tensors have no `nonzero`)
    fetched_columns: Tensor  # the columns that read a fetched row ...
    fetched_slots: Tensor  # ... and the fetched slot each reads
    segments: int


def _edges(runs: Sequence[Run], before: Sequence[Sequence[int]], halo: int, device: torch.device) -> _Edges:
    """Which rows `_HaloConv` replaces on this rank (`before[i]`: the global positions before run i in its
    document, at most `halo`, as `halo_positions` gives them; they are fetched in that order)."""
    position = {}  # local row -> global position, for the rows just before each run
    for run in runs:
        for k in range(max(0, run.length - halo), run.length):
            position[run.row + k] = run.pos + k
    out_rows: list[int] = []
    picks: list[int] = []
    history: list[int] = []
    firsts: list[int] = []
    slot, segments = 0, 0
    for run, positions in zip(runs, before):
        count = min(halo, run.length)
        slots = list(range(slot, slot + len(positions)))
        slot += len(positions)
        shard_history = [position.get(row) for row in range(run.row - halo, run.row)]
        true_history = [None] * (halo - len(positions)) + list(positions)
        if not halo or shard_history == true_history:  # the conv over the shard reads the right rows
            continue
        out_rows += range(run.row, run.row + count)
        picks += range(segments * 2 * halo, segments * 2 * halo + count)
        history += [0] * (halo - len(positions)) + [1 + k for k in slots]
        history += [-1] * count + [0] * (halo - count)
        firsts += range(run.row, run.row + count)
        segments += 1

    def index(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    # history per column: 0 for zero, 1 + slot of a fetched row, -1 for a local first row (in order)
    own = [c for c, h in enumerate(history) if h < 0]
    fetched = [c for c, h in enumerate(history) if h > 0]
    pool = list(history)
    for k, c in enumerate(own):
        pool[c] = 1 + slot + k  # `slot` ends as the number of fetched rows
    return _Edges(index(out_rows), index(picks), index(pool), index(firsts), index(own), index(fetched),
                  index([history[c] - 1 for c in fetched]), segments)


class _HaloConv(torch.autograd.Function):
    """The causal depthwise conv of a shard, `(batch, seq_local, channels)` in, `(batch, channels, seq_local)` out.

    One conv over the whole shard, channels-first (the conv's own layout, and the one Mamba's
    and GDN's callers hold: `x` is then a transposed view), computed while the halo travels;
    then the few rows `_Edges` names are replaced by a conv over their table. The backward
    writes `x`'s whole gradient once: the shard conv's, with the replaced rows' share added in
    place (this rank's first rows) and the fetched rows' gradients sent home, posted before the
    shard conv's backward so they travel while it runs (`post_gradients_home`). Composed from autograd ops instead, every piece that reads a few
    rows of `x` (the table's indexing, the fetch) costs a zero gradient the size of the shard
    and its addition, and concatenating the pieces one more copy: measured on Mamba2 at P = 2,
    that made the CP conv cost almost twice the same conv on one process's share.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, kernel: Tensor, bias: Tensor | None, posted: PostedFetch,
                edges: _Edges) -> Tensor:
        halo = kernel.shape[-1] - 1
        xc = x.transpose(1, 2)
        out = F.conv1d(xc, kernel, bias, padding=halo, groups=kernel.shape[0])[..., :x.shape[1]]
        table = _table(x, assemble_rows(x, posted.plan, posted.received()), edges)
        if edges.segments:
            fixed = F.conv1d(table, kernel, bias, groups=kernel.shape[0])
            out.index_copy_(2, edges.out_rows, fixed.index_select(2, edges.picks))
        ctx.save_for_backward(x, kernel, table)
        ctx.posted, ctx.edges, ctx.has_bias = posted, edges, bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, kernel, table = ctx.saved_tensors
        edges, plan, posted = ctx.edges, ctx.posted.plan, ctx.posted
        halo, channels = kernel.shape[-1] - 1, kernel.shape[0]
        bias_sizes = [channels] if ctx.has_bias else None
        mask = [True, ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
        # The table's few columns first: the fetched rows' gradients travel home during the shard's conv backward.
        fetched = x.new_zeros((x.shape[0], plan.count, channels))
        grad_k = grad_b = own = None
        if edges.segments:
            picked = grad.new_zeros((*grad.shape[:2], table.shape[2] - halo))
            picked.index_copy_(2, edges.picks, grad.index_select(2, edges.out_rows))
            grad_table, grad_k, grad_b = torch.ops.aten.convolution_backward(
                picked, table, kernel, bias_sizes, [1], [0], [1], False, [0], channels, mask)
            grad_table = grad_table.transpose(1, 2)  # (batch, columns, channels)
            own = grad_table.index_select(1, edges.own_columns)
            fetched.index_add_(1, edges.fetched_slots, grad_table.index_select(1, edges.fetched_columns))
        add_home = post_gradients_home(fetched, plan, posted.cp, posted.meter)
        whole = F.pad(grad, (0, halo))  # the conv's outputs past the shard read nothing back
        whole.index_fill_(2, edges.out_rows, 0)  # replaced: their gradient goes to the table
        grad_xc, grad_kernel, grad_bias = torch.ops.aten.convolution_backward(
            whole, x.transpose(1, 2), kernel, bias_sizes, [1], [halo], [1], False, [0], channels, mask)
        grad_x = grad_xc.transpose(1, 2)
        if own is not None:
            grad_x.index_add_(1, edges.firsts, own)
            grad_kernel = grad_kernel + grad_k if mask[1] else None
            grad_bias = grad_bias + grad_b if mask[2] else None
        add_home(grad_x)
        return grad_x, grad_kernel, grad_bias, None, None


def _table(x: Tensor, fetched: Tensor, edges: _Edges) -> Tensor:
    """`_Edges`'s table, channels-first `(batch, channels, segments * 2 * halo)`."""
    pool = torch.cat([x.new_zeros((x.shape[0], 1, x.shape[2])), fetched, x[:, edges.firsts]], dim=1)
    return pool[:, edges.pool_index].transpose(1, 2)
