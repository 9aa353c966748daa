"""Many blocks in one kernel call: flash-attn's varlen functions for packed documents.

A packed batch turns into many small blocks, one or more per document piece, and
on a GPU each kernel call has a fixed cost that a short document never amortises.
flash-attn's varlen functions take blocks packed end to end (`cu_seqlens` marks
where each starts) and attend within each, so all the full blocks of a plan run in
one call and all its causal blocks in another; window-edge blocks keep their own
calls (each has its own offset). Every block still gets its own output and LSE, so
the float32 merge is exactly what separate calls would give.

`VarlenGroup` holds the index tensors of one group, built once per plan and device:
the plans are cached tuples, so a warm call gathers, runs, and scatters with no
host work but the kernel launches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from cpcompose.attention.local import kernels
from cpcompose.attention.local.blocks import BlockTask
from cpcompose.attention.local.kernels import KernelArgs
from cpcompose.attention.local.merge import SoftmaxAccumulator
from cpcompose.attention.local.plan_memo import PlanMemo

__all__ = ["VarlenGroup", "backward", "forward", "groups"]


@dataclass(frozen=True)
class VarlenGroup:
    """Blocks of one kind (full or causal) as one varlen call over a batch of `batch` rows."""

    tasks: tuple[BlockTask, ...]
    causal: bool
    q_rows: Tensor  # local query rows, block after block (int64, on the device)
    kv_rows: Tensor  # local key rows, block after block
    cu_q: Tensor  # segment starts, one segment per (batch element, block), int32
    cu_k: Tensor
    max_q: int
    max_k: int
    starts: tuple[int, ...]  # where each block's rows start among q_rows

    @classmethod
    def build(cls, tasks: Sequence[BlockTask], causal: bool, batch: int, device: torch.device) -> "VarlenGroup":
        q_len = [t.q.stop - t.q.start for t in tasks]
        k_len = [t.kv.stop - t.kv.start for t in tasks]

        def rows(slices: Sequence[slice]) -> Tensor:
            return torch.cat([torch.arange(s.start, s.stop) for s in slices]).to(device)

        def bounds(lengths: list[int]) -> Tensor:  # the same segments again for each batch element
            return torch.tensor([0, *itertools.accumulate(lengths * batch)], dtype=torch.int32, device=device)

        return cls(tuple(tasks), causal, rows([t.q for t in tasks]), rows([t.kv for t in tasks]), bounds(q_len),
                   bounds(k_len), max(q_len), max(k_len), (0, *itertools.accumulate(q_len)))

    def pack(self, x: Tensor, rows: Tensor) -> Tensor:
        """`(B, H, S, D)` -> the rows of every block, batch-major: `(B * T, H, D)`."""
        b, h, _, d = x.shape
        return x.index_select(2, rows).permute(0, 2, 1, 3).reshape(b * rows.numel(), h, d)

    def unpack(self, x: Tensor, batch: int) -> Tensor:
        """`(B * T, H, D)` -> `(B, H, T, D)`."""
        return x.view(batch, -1, *x.shape[1:]).permute(0, 2, 1, 3)


def groups(tasks: Sequence[BlockTask], batch: int, device: torch.device) -> tuple[list[VarlenGroup], list]:
    """The varlen groups of a plan (full blocks, causal blocks: two or more of a kind) and the tasks left over."""

    def build() -> tuple[list[VarlenGroup], list]:
        by_kind = {kind: [t for t in tasks if t.kind == kind] for kind in ("full", "causal")}
        made = [VarlenGroup.build(ts, kind == "causal", batch, device) for kind, ts in by_kind.items() if len(ts) > 1]
        return made, [t for t in tasks if not any(t in g.tasks for g in made)]

    return _GROUPS.get(tasks, (batch, device), build)


_GROUPS = PlanMemo()


def forward(acc: SoftmaxAccumulator, q: Tensor, k: Tensor, v: Tensor, group: VarlenGroup,
            kernel: KernelArgs) -> None:
    """One varlen call for the group's blocks, each merged into `acc` as its own block."""
    batch = q.shape[0]
    out, lse = kernels.varlen_forward(
        group.pack(q, group.q_rows), group.pack(k, group.kv_rows), group.pack(v, group.kv_rows), group.cu_q,
        group.cu_k, group.max_q, group.max_k, causal=group.causal, scale=kernel.scale, softcap=kernel.softcap,
    )
    out = group.unpack(out, batch)  # (B, H, T, Dv)
    lse = lse.view(lse.shape[0], batch, -1).permute(1, 0, 2)  # (H, B*T) -> (B, H, T)
    for t, start in zip(group.tasks, group.starts):
        n = t.q.stop - t.q.start
        acc.merge(t.q, out[:, :, start : start + n], lse[:, :, start : start + n])


def backward(grads: tuple[Tensor, Tensor, Tensor], dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
             lse: Tensor, group: VarlenGroup, kernel: KernelArgs) -> None:
    """One varlen backward call for the group's blocks; adds `(dq, dk, dv)` into the float32 `grads`."""
    batch = q.shape[0]
    lse_rows = lse.index_select(2, group.q_rows).permute(1, 0, 2).reshape(lse.shape[1], -1)  # (H, B*T)
    dq, dk, dv = kernels.varlen_backward(
        group.pack(dout, group.q_rows), group.pack(q, group.q_rows), group.pack(k, group.kv_rows),
        group.pack(v, group.kv_rows), group.pack(out, group.q_rows), lse_rows, group.cu_q, group.cu_k, group.max_q,
        group.max_k, causal=group.causal, scale=kernel.scale, softcap=kernel.softcap,
    )
    for acc, part, rows in zip(grads, (dq, dk, dv), (group.q_rows, group.kv_rows, group.kv_rows)):
        acc.index_add_(2, rows, group.unpack(part, batch).to(acc.dtype))

