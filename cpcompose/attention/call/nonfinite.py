"""Non-finite values in V: the output a single-process softmax gives, exactly, on the host.

A single-process SDPA computes `out = P @ V` over every key of the row, masked ones
included with weight 0, and in IEEE arithmetic `0 * inf` and `0 * nan` are NaN: a NaN in
V, or an infinity at a key the row does not see, makes that output column NaN for the
row; an infinity at a key it sees makes it infinite. CP computes only the blocks a row
sees (fully masked blocks, and the rows no rank's plan reads, never travel), so the NaN
that masked keys would have spread is missing there.

So every call on the host tells the others, at no cost (a bit in the agreement's flags:
`agreement.expected`), whether its V holds a non-finite value; when any does, the ranks
exchange where (two tiny all-gathers: counts, then entries) and each sets the outputs
that the single-process product makes NaN. On CUDA nothing is sent per call (it would
be a device sync), and fused kernels that skip masked tiles give finite values there too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.comm import CPGroup, all_gather, rehearsing
from cpcompose.layouts import Layout

__all__ = ["NONFINITE_V", "nonfinite_note", "spread_nonfinite"]

NONFINITE_V = 1
"""The agreement note bit: this rank's V holds a NaN or an infinity."""


def nonfinite_note(v: object) -> int:
    """`NONFINITE_V` if this rank's V (on the host) holds a non-finite value, else 0.

    One sum answers it (any NaN or infinity reaches the sum, or makes it NaN; a finite
    overflow only costs an exchange that finds nothing); the device is never asked (that
    would be a sync on CUDA). In a rehearsal (`comm.rehearsal_mode`) V holds no values: 0.
    """
    if rehearsing():
        return 0
    if not isinstance(v, Tensor) or v.device.type != "cpu" or not v.is_floating_point() or v.numel() == 0:
        return 0
    with torch.no_grad():  # nothing of this may join the autograd graph (a checkpoint counts saved tensors)
        return 0 if bool(torch.isfinite(v.detach().sum())) else NONFINITE_V


def _entries(v: Tensor, layout: Layout, rank: int) -> Tensor:
    """This rank's non-finite V entries as rows `(batch, kv head, global position, column, is_nan)`."""
    bad = (~torch.isfinite(v)).nonzero()  # (n, 4): batch, head, local row, column
    positions = layout.local_indices(rank, v.shape[2] * layout.world, v.device)
    return torch.stack([bad[:, 0], bad[:, 1], positions[bad[:, 2]], bad[:, 3],
                        torch.isnan(v[bad[:, 0], bad[:, 1], bad[:, 2], bad[:, 3]]).long()], dim=1)


def _documents(layout: Layout, seq_len: int, device: torch.device) -> Tensor:
    """Each global position's document."""
    doc = torch.empty(seq_len, dtype=torch.long, device=device)
    for run in layout.global_runs(seq_len):
        doc[run.pos:run.pos + run.length] = run.doc
    return doc


def spread_nonfinite(out: Tensor, v: Tensor, layout: Layout, mask: MaskSpec, cp: CPGroup) -> Tensor:
    """`out` with NaN where the single-process `P @ V` has it (see the module docstring); collective.

    Args:
        out: this rank's output `(batch, heads, seq_local, dv)`.
        v: this rank's V `(batch, kv_heads, seq_local, dv)` (the queries' heads read kv head h // group).
        layout, mask: the call's split and mask (documents always hide other documents' keys).
    """
    mine = _entries(v.detach(), layout, cp.rank)
    count = int(all_gather(torch.tensor([mine.shape[0]], device=v.device), cp).max().item())
    padded = torch.full((count, 5), -1, dtype=torch.long, device=v.device)
    padded[: mine.shape[0]] = mine
    every = all_gather(padded, cp).reshape(-1, 5)
    every = every[every[:, 0] >= 0]
    seq_len = v.shape[2] * layout.world
    rows = layout.local_indices(cp.rank, seq_len, out.device)
    doc = _documents(layout, seq_len, out.device)
    group = out.shape[1] // v.shape[1]
    poisoned = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
    for b, hkv, j, d, is_nan in every.tolist():
        diff = rows - j  # query position minus key position
        seen = (doc[rows] == doc[j]) & (diff <= mask.reach) & (diff >= -mask.right_reach)
        hit = torch.ones_like(seen) if is_nan else ~seen
        poisoned[b, hkv * group:(hkv + 1) * group, :, d] |= hit
    return out.masked_fill(poisoned, float("nan"))
