"""Running a block plan on the kernels: each block's partial result merged through its LSE.

The plan (`cpcompose.attention.local.blocks`) says which blocks to compute; this module runs
them on the backend the call chose, letting a backend rewrite the plan first where it
has a faster form: flash-attn's varlen calls (`varlen.py`: many blocks in one call)
and the CPU kernel's causal row tiles (`cpu_tiles.py`).
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from cpcompose.attention.local import cpu_tiles, varlen
from cpcompose.attention.local.blocks import BlockTask
from cpcompose.attention.local.kernels import KernelArgs, attention_backward, attention_forward, supports_varlen
from cpcompose.attention.local.merge import SoftmaxAccumulator

__all__ = ["backward_blocks", "forward_blocks"]


def forward_blocks(
    acc: SoftmaxAccumulator, q: Tensor, k: Tensor, v: Tensor, tasks: Sequence[BlockTask], kernel: KernelArgs
) -> None:
    """Run the tasks' forward kernels and merge each into `acc` (varlen groups where the kernel has them)."""
    if supports_varlen(kernel.backend):
        grouped, tasks = varlen.groups(tasks, q.shape[0], q.device)
        for group in grouped:
            varlen.forward(acc, q, k, v, group, kernel)
    elif kernel.backend == "cpu_flash":
        tasks = cpu_tiles.cpu_tasks(tasks)
    for t in tasks:
        out, lse = attention_forward(
            q[:, :, t.q], k[:, :, t.kv], v[:, :, t.kv], causal=t.kind == "causal", scale=kernel.scale,
            backend=kernel.backend, band=t.band, softcap=kernel.softcap,
        )
        acc.merge(t.q, out, lse)


def backward_blocks(
    grads: tuple[Tensor, Tensor, Tensor],
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    tasks: Sequence[BlockTask],
    kernel: KernelArgs,
) -> None:
    """Add the tasks' `(dq, dk, dv)` into the float32 accumulators `grads`."""
    dq_acc, dk_acc, dv_acc = grads
    if supports_varlen(kernel.backend):
        grouped, tasks = varlen.groups(tasks, q.shape[0], q.device)
        for group in grouped:
            varlen.backward(grads, dout, q, k, v, out, lse, group, kernel)
    elif kernel.backend == "cpu_flash":
        tasks = cpu_tiles.cpu_tasks(tasks)
    for t in tasks:
        dq, dk, dv = attention_backward(
            dout[:, :, t.q], q[:, :, t.q], k[:, :, t.kv], v[:, :, t.kv], out[:, :, t.q], lse[:, :, t.q],
            causal=t.kind == "causal", scale=kernel.scale, backend=kernel.backend, band=t.band,
            softcap=kernel.softcap,
        )
        dq_acc[:, :, t.q] += dq
        dk_acc[:, :, t.kv] += dk
        dv_acc[:, :, t.kv] += dv
