"""Which (query block, key block) pairs to compute, and with which mask: pure index arithmetic.

A local tensor (this rank's queries, or a block of keys/values) is described by
*runs*: stretches of consecutive global positions of one document, stored in
consecutive local rows, in increasing position. Zigzag and contiguous layouts
give one or two runs per rank (one document: the whole sequence); a packed
sequence gives runs per document piece.

Query i may see key j when both are in the same document and
`i - left <= j <= i + right` (flash-attn's window sizes, either side possibly
unbounded; causal attention is right = 0). The planner turns two run lists into
the fewest kernel calls that cover exactly the visible pairs:

* `full`: every pair visible (keys wholly before or after the queries, within the window);
* `causal`: the same positions on both sides, a square causal mask;
* `band`: anything else (window edges), with an explicit additive mask, tiled so
  the mask stays small and every row keeps at least one visible key.

Fully masked pairs are never computed: a fully masked row comes back from the CPU
kernel with lse=0 instead of -inf and would poison the merge. Every strategy uses
this planner, so the masks are written once. Running the blocks on a kernel is
`cpcompose.attention.local.execute`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import Tensor

from cpcompose.attention.local.kernels import UNBOUNDED, Band
from cpcompose.layouts import Run

__all__ = ["BAND_TILE", "NO_WINDOW", "BlockTask", "MaskSpec", "needed_rows", "one_kernel_call", "plan", "split_work"]

NO_WINDOW = UNBOUNDED
BAND_TILE = 512  # rows per band tile: masks stay under 512 x 1024 elements, whatever the window


@dataclass(frozen=True)
class MaskSpec:
    """The attention mask by global position: documents always, causal, a window on each side.

    Query i sees key j of the same document iff `i - left <= j <= i + right`, with
    flash-attn's `(left, right)` window sizes; None is unbounded on that side.
    `causal` forces right = 0, so `MaskSpec(True, W)` is the causal sliding window.
    """

    causal: bool
    window: int | None = None  # left size: keys at most this many positions before the query
    right: int | None = None  # right size: keys at most this many positions after (ignored if causal)

    @property
    def reach(self) -> int:
        """How far left a query sees (the left window, or unbounded)."""
        return NO_WINDOW if self.window is None else self.window

    @property
    def right_reach(self) -> int:
        """How far right a query sees: 0 when causal."""
        if self.causal:
            return 0
        return NO_WINDOW if self.right is None else self.right


@dataclass(frozen=True)
class BlockTask:
    """One kernel call: local query rows `q` against local key rows `kv`.

    For a `band`, query row `q.start + a` has position `offset + a` relative to key
    row `kv.start` (so key `b` is visible iff `-right <= offset + a - b <= window`).
    """

    q: slice
    kv: slice
    kind: Literal["full", "causal", "band"]
    offset: int = 0
    window: int = NO_WINDOW
    right: int = 0

    @property
    def band(self) -> Band | None:
        """What the kernel needs to mask a `band` (None for full and causal blocks, which need nothing)."""
        return Band(self.offset, self.window, self.right) if self.kind == "band" else None

    def visible(self, device: torch.device | str | None = None) -> Tensor:
        """The boolean mask of this block `(len(q), len(kv))`."""
        nq, nk = self.q.stop - self.q.start, self.kv.stop - self.kv.start
        if self.kind == "full":
            return torch.ones(nq, nk, dtype=torch.bool, device=device)
        return Band(self.offset if self.kind == "band" else 0, self.window, self.right).visible(nq, nk, device)

    def flops_weight(self) -> float:
        """Query x key pairs actually visible (what a masked kernel has to compute)."""
        nq, nk = self.q.stop - self.q.start, self.kv.stop - self.kv.start
        if self.kind == "full":
            return float(nq * nk)
        if self.kind == "causal" and self.window >= nq:
            return nq * (nq + 1) / 2
        return float(Band(self.offset if self.kind == "band" else 0, self.window, self.right).count(nq, nk))


def plan(q_runs: Sequence[Run], kv_runs: Sequence[Run], mask: MaskSpec) -> list[BlockTask]:
    """Kernel calls covering exactly the visible (query, key) pairs between two run lists."""
    left, right = mask.reach, mask.right_reach
    if right == 0 and left == NO_WINDOW and _same_single_document(q_runs, kv_runs):
        # Same increasing positions of one document: local order is global order.
        rows = slice(q_runs[0].row, q_runs[-1].row + q_runs[-1].length)
        return [BlockTask(rows, slice(kv_runs[0].row, kv_runs[-1].row + kv_runs[-1].length), "causal")]
    by_doc: dict[int, list[Run]] = {}
    for k in kv_runs:
        by_doc.setdefault(k.doc, []).append(k)
    tasks: list[BlockTask] = []
    for q in q_runs:
        for k in by_doc.get(q.doc, ()):
            tasks += _pair(q, k, left, right)
    return _merge_full(tasks)


def _same_single_document(q_runs: Sequence[Run], kv_runs: Sequence[Run]) -> bool:
    same = [(r.pos, r.length) for r in q_runs] == [(r.pos, r.length) for r in kv_runs]
    return same and len({r.doc for r in (*q_runs, *kv_runs)}) == 1 and bool(q_runs)


def _task(q: Run, q0: int, q1: int, k: Run, k0: int, k1: int, kind: str, left: int = NO_WINDOW,
          right: int = 0) -> BlockTask:
    """A task for positions [q0, q1) of run q against positions [k0, k1) of run k."""
    return BlockTask(
        slice(q.row + q0 - q.pos, q.row + q1 - q.pos), slice(k.row + k0 - k.pos, k.row + k1 - k.pos),
        kind, offset=q0 - k0, window=left, right=right,  # type: ignore[arg-type]
    )


def _pair(q: Run, k: Run, left: int, right: int) -> list[BlockTask]:
    """Attention of one query run to one key run of the same document, within the `(left, right)` window.

    With a side unbounded, the keys split into those before, among, and after the
    queries' own positions: the first and last are then mostly full blocks and the
    middle causal or full, so most of the work goes to unmasked kernel calls. With
    both sides bounded the window itself decides, and fewer blocks mean fewer
    float32 merges per row.
    """
    q0, q1, k0, k1 = q.pos, q.pos + q.length, k.pos, k.pos + k.length
    if left < NO_WINDOW and right < NO_WINDOW:
        return _cover(q, q0, q1, k, k0, k1, left, right)
    tasks = []
    for c0, c1 in ((k0, min(k1, q0)), (max(k0, q0), min(k1, q1)), (max(k0, q1), k1)):
        if c0 < c1:
            tasks += _cover(q, q0, q1, k, c0, c1, left, right)
    return tasks


def _cover(q: Run, a0: int, a1: int, k: Run, c0: int, c1: int, left: int, right: int) -> list[BlockTask]:
    """Query positions [a0, a1) against keys [c0, c1): the fewest full/causal blocks plus small bands.

    Rows and keys are first trimmed to those with a visible pair, so no task has a
    fully masked row (the CPU kernel would return lse=0 for it, poisoning the merge).
    A block that is not all visible is cut into row tiles of BAND_TILE; a tile
    wider than 2 x BAND_TILE keys is cut into the keys every row sees (a full block)
    and the edges on either side (bands under BAND_TILE wide), so masks stay small
    however wide the window.
    """
    lo, hi = max(c0, a0 - left), min(c1, a1 + right)  # keys some query sees
    r0, r1 = max(a0, lo - right), min(a1, hi + left)  # queries that see one of them
    if lo >= hi or r0 >= r1:
        return []
    if (r1 - 1) - lo <= left and (hi - 1) - r0 <= right:
        return [_task(q, r0, r1, k, lo, hi, "full")]
    if right == 0 and (lo, hi) == (r0, r1) and r1 - r0 - 1 <= left:
        return [_task(q, r0, r1, k, lo, hi, "causal", left)]
    if r1 - r0 > BAND_TILE:
        tiles = [(a, min(a + BAND_TILE, r1)) for a in range(r0, r1, BAND_TILE)]
        return [t for a, b in tiles for t in _cover(q, a, b, k, lo, hi, left, right)]
    f0, f1 = max(lo, r1 - 1 - left), min(hi, r0 + right + 1)  # keys every row of the tile sees
    if f0 < f1 and hi - lo > 2 * BAND_TILE:
        return [*_cover(q, r0, r1, k, lo, f0, left, right), _task(q, r0, r1, k, f0, f1, "full"),
                *_cover(q, r0, r1, k, f1, hi, left, right)]
    return [_task(q, r0, r1, k, lo, hi, "band", left, right)]


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


def split_work(tasks: Sequence[BlockTask]) -> tuple[tuple[BlockTask, ...], tuple[BlockTask, ...]]:
    """The tasks, in order, as two parts of about equal work (the first part takes a lone task).

    A strategy computes the first part while one transfer travels and the second
    while another does (the K/V arriving, the gradients leaving): a transfer at the
    very start or end of a pass has no other computation to hide behind.
    """
    weights = [t.flops_weight() for t in tasks]
    total, done = sum(weights), 0.0
    for i, w in enumerate(weights):
        if done + w / 2 >= total / 2 and i > 0:
            return tuple(tasks[:i]), tuple(tasks[i:])
        done += w
    return tuple(tasks), ()


def one_kernel_call(tasks: Sequence[BlockTask], rows: int) -> bool:
    """Whether a full-sequence plan is one block over all `rows` that the kernel masks itself.

    Then it runs as one kernel call on the whole tensors (no slicing, no merge, no
    tiling: a single document's causal mask is the kernel's own); all-to-all runs it so
    and the cost model reads the same rule.
    """
    return len(tasks) == 1 and tasks[0].q == tasks[0].kv == slice(0, rows) and tasks[0].kind != "band"
