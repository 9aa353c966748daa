"""Which (query block, key block) pairs to compute, with which mask, and running them.

Both layouts cut the global sequence into equal chunks and give each rank a few of
them, in increasing order (zigzag: chunks r and 2P-1-r of 2P; contiguous: chunk r
of P). Under a causal mask a query chunk i sees key chunk j fully if j < i, with a
square causal mask if j == i, and not at all if j > i. This module turns a pair of
chunk lists into the fewest kernel calls that cover exactly the visible pairs;
fully masked pairs are never computed (a fully masked row would come back with
lse=0 instead of -inf and poison the merge). Every strategy uses this planner, so
the masks are written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import Tensor

from cpcompose.attention.kernels import Backend, attention_backward, attention_forward
from cpcompose.attention.merge import SoftmaxAccumulator


@dataclass(frozen=True)
class BlockTask:
    """One kernel call: query tokens `q` against key tokens `kv` (local slices)."""

    q: slice
    kv: slice
    causal: bool

    def flops_weight(self) -> float:
        """Query×key pairs computed (a causal square block computes about half)."""
        nq, nk = self.q.stop - self.q.start, self.kv.stop - self.kv.start
        return nq * nk / 2 if self.causal else float(nq * nk)


def plan_blocks(
    q_chunks: Sequence[int], kv_chunks: Sequence[int], chunk_len: int, *, causal: bool
) -> list[BlockTask]:
    """Kernel calls for local query chunks against a tensor of key chunks.

    Args:
        q_chunks: global chunk ids of the local queries, increasing.
        kv_chunks: global chunk ids held by the key/value tensor, increasing.
        chunk_len: tokens per chunk.
        causal: apply the causal mask by global position.

    Returns:
        Tasks with slices into the local query tensor and the key/value tensor.
    """
    whole_q = slice(0, len(q_chunks) * chunk_len)
    whole_kv = slice(0, len(kv_chunks) * chunk_len)
    if not causal:
        return [BlockTask(whole_q, whole_kv, False)]
    if list(q_chunks) == list(kv_chunks):
        # Same increasing positions on both sides: local order is global order.
        return [BlockTask(whole_q, whole_kv, True)]
    tasks: list[BlockTask] = []
    run_start, run_prefix = 0, 0  # consecutive query chunks seeing the same key prefix
    for i, chunk in enumerate(list(q_chunks) + [None]):
        prefix = sum(1 for j in kv_chunks if chunk is not None and j < chunk)
        if chunk is None or prefix != run_prefix:
            if run_prefix > 0 and i > run_start:
                tasks.append(
                    BlockTask(
                        slice(run_start * chunk_len, i * chunk_len),
                        slice(0, run_prefix * chunk_len),
                        False,
                    )
                )
            run_start, run_prefix = i, prefix
        if chunk is not None and chunk in kv_chunks:
            q_rows = slice(i * chunk_len, (i + 1) * chunk_len)
            k_rows = slice(prefix * chunk_len, (prefix + 1) * chunk_len)
            tasks.append(BlockTask(q_rows, k_rows, True))
    return tasks


@dataclass(frozen=True)
class KernelArgs:
    """What every kernel call of one attention shares."""

    scale: float
    backend: Backend


def forward_blocks(
    acc: SoftmaxAccumulator, q: Tensor, k: Tensor, v: Tensor, tasks: Sequence[BlockTask], kernel: KernelArgs
) -> None:
    """Run the tasks' forward kernels and merge each into `acc`."""
    for t in tasks:
        out, lse = attention_forward(
            q[:, :, t.q], k[:, :, t.kv], v[:, :, t.kv], causal=t.causal, scale=kernel.scale, backend=kernel.backend
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
    for t in tasks:
        dq, dk, dv = attention_backward(
            dout[:, :, t.q], q[:, :, t.q], k[:, :, t.kv], v[:, :, t.kv], out[:, :, t.q], lse[:, :, t.q],
            causal=t.causal, scale=kernel.scale, backend=kernel.backend,
        )
        dq_acc[:, :, t.q] += dq
        dk_acc[:, :, t.kv] += dk
        dv_acc[:, :, t.kv] += dv
