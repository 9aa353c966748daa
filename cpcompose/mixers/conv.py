"""Exact causal depthwise convolution over a CP-sharded sequence.

Mamba-style blocks mix each channel over its last `width` tokens. On a shard the
first width-1 outputs of every run would read tokens held elsewhere (under zigzag
each of a rank's two chunks has its own predecessor; in a pack a predecessor may
span several ranks or be local), so each run gets the width-1 positions before it,
same document only, in one exchange (`halo.post_fetch`), posted before the outputs
that read no halo (all but each run's first width-1) are computed, so it travels
behind them; a document start gets zeros, as if the convolution restarted there.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layouts import Layout, LayoutSpec
from cpcompose.mixers._checks import agree, float_tensors_error, layout_fields, local_layout, shape_of
from cpcompose.mixers.halo import post_fetch

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
    agree(cp, error, signature, what="cp_causal_conv1d", device=device)
    assert split is not None
    return _causal_conv(x, weight.reshape(weight.shape[0], weight.shape[-1]), bias, cp, split, activation, meter)


def _causal_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, cp: CPGroup, layout: Layout, activation: str | None,
    meter: CommMeter | None,
) -> Tensor:
    """The conv on checked inputs. The halo exchange is posted first; the outputs that read only their own
    run's rows (all but each run's first `halo`) are computed while it travels, then each run's first ones
    from [zeros before its document, the fetched halo, its first rows].

    Everything runs channels-first, `(batch, channels, seq)`, the conv's own layout (and the one Mamba's
    and GDN's callers hold: `x` is then a transposed view): rows are taken by slices or by indexing a few
    positions, never by selecting along a strided dim, which would copy the whole shard through a transpose
    (measured: about as long as the conv itself, several times per call).
    """
    batch, seq_local, channels = x.shape
    halo, seq_len = weight.shape[1] - 1, seq_local * cp.world
    runs = layout.runs(cp.rank, seq_len)
    wanted = halo_positions(layout, seq_len, halo)
    posted = post_fetch(x, [sum(w, []) for w in wanted], cp=cp, layout=layout, seq_len=seq_len, meter=meter)
    kernel, xc = weight.unsqueeze(1), x.transpose(1, 2)
    counts = [min(halo, run.length) for run in runs]  # each run's first rows, which read its halo
    # Output row r reads rows r-halo..r: inside its run for all but the run's first `halo` rows, and the
    # runs are the local rows in order, so one conv over the shard (no padding) gives them: row r at r - halo.
    inner = F.conv1d(xc, kernel, bias, groups=channels) if seq_local > halo else None
    edges = None
    if halo:  # (at width 1 nothing moves and every row is inner)
        # One small table [zero column, each run's first rows, the fetched rows]; each run's segment is `halo`
        # columns of history (zeros before its document's start), then its first rows.
        firsts = [r for run, count in zip(runs, counts) for r in range(run.row, run.row + count)]
        table = torch.cat([xc.new_zeros(batch, channels, 1), xc[..., torch.tensor(firsts, device=x.device)],
                           posted.rows().transpose(1, 2)], dim=2)
        index: list[int] = []
        fetched = 1 + len(firsts)
        first = 1
        for count, before in zip(counts, wanted[cp.rank]):
            index += [0] * (halo - len(before)) + list(range(fetched, fetched + len(before)))
            index += range(first, first + count)
            fetched, first = fetched + len(before), first + count
        # Output j of a padding-free conv reads columns j..j+halo: a segment's outputs start where it does.
        edges = F.conv1d(table[..., torch.tensor(index, device=x.device)], kernel, bias, groups=channels)
    pieces, segment = [], 0
    for run, count in zip(runs, counts):
        if count:
            assert edges is not None
            pieces.append(edges[..., segment:segment + count])
        segment += halo + count
        if run.length > count:
            assert inner is not None
            pieces.append(inner[..., run.row + count - halo:run.row + run.length - halo])
    out = torch.cat(pieces, dim=2) if pieces else xc.new_zeros(batch, channels, 0)
    return (F.silu(out) if activation == "silu" else out).transpose(1, 2)
