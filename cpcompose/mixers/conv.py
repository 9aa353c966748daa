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
    from [zeros before its document, the fetched halo, its first rows]."""
    batch, seq_local, channels = x.shape
    halo, seq_len = weight.shape[1] - 1, seq_local * cp.world
    runs = layout.runs(cp.rank, seq_len)
    wanted = halo_positions(layout, seq_len, halo)
    posted = post_fetch(x, [sum(w, []) for w in wanted], cp=cp, layout=layout, seq_len=seq_len, meter=meter)
    kernel = weight.unsqueeze(1)
    # Output row r reads rows r-halo..r: inside its run for all but the run's first `halo` rows, and the
    # runs are the local rows in order, so one conv over x (no padding) gives them: x's row r at r - halo.
    inner = [r for run in runs for r in range(run.row + min(halo, run.length), run.row + run.length)]
    pieces = []
    if inner:
        local = F.conv1d(x.transpose(1, 2), kernel, bias, groups=channels).transpose(1, 2)
        pieces.append(local.index_select(1, torch.tensor([r - halo for r in inner], device=x.device)))
    edge = [r for run in runs for r in range(run.row, run.row + min(halo, run.length))]
    if edge:  # (none only at width 1, where nothing moves)
        # One table [zero row, local rows, fetched rows]; each run's segment is `halo` rows of history
        # (zeros before its document's start), then its first rows.
        table = torch.cat([x.new_zeros(batch, 1, channels), x, posted.rows()], dim=1)
        index: list[int] = []
        keep: list[int] = []
        first_fetched = 1 + seq_local
        for run, before in zip(runs, wanted[cp.rank]):
            count = min(halo, run.length)
            # Output j of a padding-free conv reads inputs j..j+halo: the segment's outputs start where it does.
            keep += range(len(index), len(index) + count)
            index += [0] * (halo - len(before)) + list(range(first_fetched, first_fetched + len(before)))
            index += range(1 + run.row, 1 + run.row + count)
            first_fetched += len(before)
        segments = table.index_select(1, torch.tensor(index, dtype=torch.long, device=x.device))
        out = F.conv1d(segments.transpose(1, 2), kernel, bias, groups=channels).transpose(1, 2)
        pieces.append(out.index_select(1, torch.tensor(keep, dtype=torch.long, device=x.device)))
    order = torch.empty(seq_local, dtype=torch.long, device=x.device)
    order[torch.tensor(inner + edge, dtype=torch.long, device=x.device)] = torch.arange(seq_local, device=x.device)
    out = torch.cat(pieces, dim=1).index_select(1, order)
    return F.silu(out) if activation == "silu" else out
