"""Which (query block, key block) pairs to compute, with which mask, and running them.

A local tensor (this rank's queries, or a block of keys/values) is described by
*runs*: stretches of consecutive global positions of one document, stored in
consecutive local rows, in increasing position. Zigzag and contiguous layouts
give one or two runs per rank (one document: the whole sequence); a packed
sequence gives runs per document piece.

Query i may see key j when both are in the same document and, for causal
attention, `j <= i`, and with a sliding window also `i - j <= window`. The planner
turns two run lists into the fewest kernel calls that cover exactly the visible
pairs:

* `full`: every pair visible (keys wholly before the queries, within the window);
* `causal`: the same positions on both sides, a square causal mask;
* `band`: anything else (window edges), with an explicit additive mask, tiled so
  the mask stays small and every row keeps at least one visible key.

Fully masked pairs are never computed: a fully masked row comes back from the CPU
kernel with lse=0 instead of -inf and would poison the merge. Every strategy uses
this planner, so the masks are written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import Tensor

from cpcompose.attention.kernels import Backend, attention_backward, attention_forward
from cpcompose.attention.merge import SoftmaxAccumulator
from cpcompose.layouts import Run

NO_WINDOW = 1 << 62
BAND_TILE = 512  # rows per band tile: masks stay <= 512 x (512 + window) elements


@dataclass(frozen=True)
class MaskSpec:
    """The attention mask by global position: documents always, causal, a left window."""

    causal: bool
    window: int | None = None  # keys at most `window` positions to the left (flash-attn's left size)

    @property
    def reach(self) -> int:
        return NO_WINDOW if self.window is None else self.window


@dataclass(frozen=True)
class BlockTask:
    """One kernel call: local query rows `q` against local key rows `kv`.

    For a `band`, query row `q.start + a` has position `offset + a` relative to key
    row `kv.start` (so key `b` is visible iff `0 <= offset + a - b <= window`).
    """

    q: slice
    kv: slice
    kind: Literal["full", "causal", "band"]
    offset: int = 0
    window: int = NO_WINDOW

    def visible(self, device: torch.device | str | None = None) -> Tensor:
        """The boolean mask of this block `(len(q), len(kv))`."""
        if self.kind == "full":
            return torch.ones(self.q.stop - self.q.start, self.kv.stop - self.kv.start, dtype=torch.bool, device=device)
        offset = self.offset if self.kind == "band" else 0
        d = (torch.arange(self.q.stop - self.q.start, device=device)[:, None] + offset
             - torch.arange(self.kv.stop - self.kv.start, device=device)[None, :])
        return (d >= 0) & (d <= self.window)

    def additive_mask(self, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """The float mask a `band` needs (0 visible, -inf hidden); None for the other kinds."""
        if self.kind != "band":
            return None
        mask = torch.zeros(self.q.stop - self.q.start, self.kv.stop - self.kv.start, dtype=dtype, device=device)
        return mask.masked_fill_(~self.visible(device), float("-inf"))

    def flops_weight(self) -> float:
        """Query x key pairs actually visible (what a masked kernel has to compute)."""
        nq, nk = self.q.stop - self.q.start, self.kv.stop - self.kv.start
        if self.kind == "full":
            return float(nq * nk)
        if self.kind == "causal" and self.window >= nq:
            return nq * (nq + 1) / 2
        return float(self.visible().sum())


def plan(q_runs: Sequence[Run], kv_runs: Sequence[Run], mask: MaskSpec) -> list[BlockTask]:
    """Kernel calls covering exactly the visible (query, key) pairs between two run lists."""
    if mask.causal and mask.window is None and _same_single_document(q_runs, kv_runs):
        # Same increasing positions of one document: local order is global order.
        rows = slice(q_runs[0].row, q_runs[-1].row + q_runs[-1].length)
        return [BlockTask(rows, slice(kv_runs[0].row, kv_runs[-1].row + kv_runs[-1].length), "causal")]
    by_doc: dict[int, list[Run]] = {}
    for k in kv_runs:
        by_doc.setdefault(k.doc, []).append(k)
    tasks: list[BlockTask] = []
    for q in q_runs:
        for k in by_doc.get(q.doc, ()):
            tasks += _pair(q, k, mask) if mask.causal else [_task(q, q.pos, q.pos + q.length, k, k.pos, k.pos + k.length, "full")]
    return _merge_full(tasks)


def _same_single_document(q_runs: Sequence[Run], kv_runs: Sequence[Run]) -> bool:
    same = [(r.pos, r.length) for r in q_runs] == [(r.pos, r.length) for r in kv_runs]
    return same and len({r.doc for r in (*q_runs, *kv_runs)}) == 1 and bool(q_runs)


def _task(q: Run, q0: int, q1: int, k: Run, k0: int, k1: int, kind: str, window: int = NO_WINDOW) -> BlockTask:
    """A task for positions [q0, q1) of run q against positions [k0, k1) of run k."""
    return BlockTask(
        slice(q.row + q0 - q.pos, q.row + q1 - q.pos), slice(k.row + k0 - k.pos, k.row + k1 - k.pos),
        kind, offset=q0 - k0, window=window,  # type: ignore[arg-type]
    )


def _pair(q: Run, k: Run, mask: MaskSpec) -> list[BlockTask]:
    """Causal (windowed) attention of one query run to one key run of the same document."""
    w = mask.reach
    q0, q1, k0, k1 = q.pos, q.pos + q.length, k.pos, k.pos + k.length
    tasks = []
    before = (max(k0, q0 - w), min(k1, q0))  # keys left of every query that some query sees
    if before[0] < before[1]:
        if (q1 - 1) - before[0] <= w:
            tasks.append(_task(q, q0, q1, k, *before, "full"))
        else:
            tasks += _tiles(q, q0, q1, k, *before, w)
    inside = (max(k0, q0), min(k1, q1))  # keys among the queries' own positions
    if inside[0] < inside[1]:
        if inside == (q0, q1) and q1 - q0 - 1 <= w:
            tasks.append(_task(q, q0, q1, k, q0, q1, "causal", w))
        else:
            tasks += _tiles(q, inside[0], q1, k, *inside, w)
    return tasks


def _tiles(q: Run, a0: int, a1: int, k: Run, c0: int, c1: int, w: int) -> list[BlockTask]:
    """Query positions [a0, a1) against keys [c0, c1), causal within window `w`, in row tiles."""
    tasks = []
    for a in range(a0, a1, BAND_TILE):
        b = min(a + BAND_TILE, a1)
        lo, hi = max(c0, a - w), min(c1, b)  # keys some row of the tile sees
        r0, r1 = max(a, lo), min(b, hi + w)  # rows that see at least one of them
        if lo >= hi or r0 >= r1:
            continue
        if hi - 1 <= r0 and (r1 - 1) - lo <= w:
            tasks.append(_task(q, r0, r1, k, lo, hi, "full"))
        elif (lo, hi) == (r0, r1) and r1 - r0 - 1 <= w:
            tasks.append(_task(q, r0, r1, k, lo, hi, "causal", w))
        else:
            tasks.append(_task(q, r0, r1, k, lo, hi, "band", w))
    return tasks


def _merge_full(tasks: list[BlockTask]) -> list[BlockTask]:
    """Join full blocks that share their key rows (adjacent queries) or query rows (adjacent keys).

    The union of two full blocks with the same rows and adjacent columns is a full
    block, so fewer, larger kernel calls compute exactly the same pairs.
    """
    changed = True
    while changed:
        changed = False
        full = sorted((t for t in tasks if t.kind == "full"), key=lambda t: (t.kv.start, t.kv.stop, t.q.start))
        other = [t for t in tasks if t.kind != "full"]
        merged: list[BlockTask] = []
        for t in full:
            last = merged[-1] if merged else None
            if last is not None and last.kv == t.kv and last.q.stop == t.q.start:
                merged[-1] = BlockTask(slice(last.q.start, t.q.stop), t.kv, "full")
                changed = True
            else:
                merged.append(t)
        merged.sort(key=lambda t: (t.q.start, t.q.stop, t.kv.start))
        joined: list[BlockTask] = []
        for t in merged:
            last = joined[-1] if joined else None
            if last is not None and last.q == t.q and last.kv.stop == t.kv.start:
                joined[-1] = BlockTask(t.q, slice(last.kv.start, t.kv.stop), "full")
                changed = True
            else:
                joined.append(t)
        tasks = joined + other
    return tasks


def needed_rows(tasks: Sequence[BlockTask]) -> list[slice]:
    """The key rows the tasks read, as sorted, disjoint, merged slices."""
    spans = sorted((t.kv.start, t.kv.stop) for t in tasks)
    out: list[list[int]] = []
    for start, stop in spans:
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return [slice(a, b) for a, b in out]


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
            q[:, :, t.q], k[:, :, t.kv], v[:, :, t.kv], causal=t.kind == "causal", scale=kernel.scale,
            backend=kernel.backend, mask=t.additive_mask(q.dtype, q.device),
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
            causal=t.kind == "causal", scale=kernel.scale, backend=kernel.backend,
            mask=t.additive_mask(q.dtype, q.device),
        )
        dq_acc[:, :, t.q] += dq
        dk_acc[:, :, t.kv] += dk
        dv_acc[:, :, t.kv] += dv
