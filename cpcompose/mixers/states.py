"""State passing for chunked linear recurrences: the true state entering each local run.

A linear recurrence (a selective scan, a gated delta rule) run from a zero state
over one run of tokens ends in `final`; started from `init` instead, it ends in
`transition ∘ init + final`. So each rank scans its runs locally, all ranks share
the (transition, final) summary of every run that a later run of its document
continues (one all-gather, bytes O(P x state), independent of the sequence length;
whole documents never travel), and every rank composes the summaries of the runs
before its own, per document in global order, to get each run's true initial
state. The backward of the all-gather is a reduce-scatter: gradients flow from
later runs to earlier ones across ranks.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter, CPGroup, start_all_gather, start_reduce_scatter
from cpcompose.layouts import Layout, LayoutSpec, Run
from cpcompose.mixers._checks import agree, float_tensors_error, layout_fields, seq_layout, shape_of
from cpcompose.precision import accumulation_dtype

__all__ = [
    "KINDS", "Kind", "PostedSummaries", "compose_posted", "continued_runs", "cp_initial_states", "initial_states",
    "post_summaries", "tie",
]

Kind = Literal["diagonal", "matrix"]
KINDS: tuple[str, ...] = ("diagonal", "matrix")


class _Gathered(torch.autograd.Function):
    """`arrived` (every rank's `x` stacked in rank order, already waited for) in `x`'s graph; the backward
    sums each rank's slice of the gradient back to it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, arrived: Tensor, cp: CPGroup, meter: CommMeter | None) -> Tensor:
        ctx.cp, ctx.meter = cp, meter
        return arrived.view_as(arrived)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _reduce_home(grad, ctx.cp, ctx.meter), None, None, None


def _reduce_home(grad: Tensor, cp: CPGroup, meter: CommMeter | None) -> Tensor:
    """The gathered table's gradient summed back to each rank's own rows (the all-gather's backward)."""
    return start_reduce_scatter(grad.contiguous(), cp, meter).wait()


class _Anchor(torch.autograd.Function):
    """`_Gathered`'s backward (the reduce-scatter), entered into autograd when the gather is posted: its output is
    a placeholder shaped like the gathered table, which `_Join` replaces by the data once it has arrived.

    A blocking collective in the backward runs when it is the latest-created node whose gradient is ready; created
    at the post, it runs after the backward of everything computed while the gather travelled.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, cp: CPGroup, meter: CommMeter | None, world: int) -> Tensor:
        ctx.cp, ctx.meter = cp, meter
        return x.new_empty((world, *x.shape))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _reduce_home(grad, ctx.cp, ctx.meter), None, None, None


class _Join(torch.autograd.Function):
    """The arrived table in place of `_Anchor`'s placeholder; the gradient goes to the placeholder unchanged."""

    @staticmethod
    def forward(ctx: Any, placeholder: Tensor, arrived: Tensor) -> Tensor:
        return arrived.view_as(arrived)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _Tie(torch.autograd.Function):
    """`out` unchanged, with `dep` in its graph.

    A rank whose runs all start documents composes nothing, so its result would not
    depend on the gathered summaries, and its backward would skip the reduce-scatter
    that the other ranks' backwards wait in (and that carries its own gradients).
    """

    @staticmethod
    def forward(ctx: Any, out: Tensor, dep: Tensor) -> Tensor:
        ctx.dep = (dep.shape, dep.dtype, dep.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        shape, dtype, device = ctx.dep
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def tie(out: Tensor, dep: Tensor) -> Tensor:
    """`out`, with `dep` (the composed states) in its graph: every rank's backward then reaches the
    summaries' all-gather and joins its reduce-scatter, whether or not its result read them."""
    return _Tie.apply(out, dep)  # type: ignore[no-any-return]


def _summary_error(final: Tensor, transition: Tensor, kind: object, runs: int) -> str | None:
    error = float_tensors_error(final=final, transition=transition)
    if error:
        return error
    if kind not in KINDS:
        return f"kind={kind!r} is unknown; choose one of {KINDS}"
    state_dims = 1 if kind == "diagonal" else 2
    if final.ndim < 1 + state_dims or final.shape[0] != runs:
        return (f"final must be (runs, *state) with {runs} runs (this rank's runs in the layout) and a "
                f"{state_dims}-D or larger state, got shape {tuple(final.shape)}")
    if transition.ndim != final.ndim or transition.shape[0] != runs:
        return (f"transition must have final's {final.ndim} dims and {runs} runs, got shape "
                f"{tuple(transition.shape)} for final {tuple(final.shape)}")
    if kind == "diagonal":
        batch_t, batch_s = transition.shape[1:], final.shape[1:]
    else:
        d = final.shape[-2]
        if transition.shape[-2:] != (d, d):
            return (f"a matrix transition acts on the state's dim -2 ({d}): it must end in ({d}, {d}), "
                    f"got {tuple(transition.shape)}")
        batch_t, batch_s = transition.shape[1:-2], final.shape[1:-2]
    if any(t not in (1, s) for t, s in zip(batch_t, batch_s)):
        return f"transition {tuple(transition.shape)} does not broadcast to final {tuple(final.shape)}"
    return None


def cp_initial_states(
    final: Tensor, transition: Tensor, *, mesh: DeviceMesh, layout: LayoutSpec, seq_len: int, kind: Kind,
    meter: CommMeter | None = None,
) -> Tensor:
    """The true state entering each of this rank's runs, composed over every run before it in its document.

    Args:
        final: `(R, *state)`, the state each of this rank's R runs (`layout.runs`) ends in from a zero state.
        transition: how a run maps its initial state to its end state. kind "diagonal":
            `end = transition * init + final`, transition `(R, ...)` with final's dims, each
            1 or equal (e.g. decay products). kind "matrix": `end = transition @ init + final`,
            transition `(R, ..., d, d)` acting on the state's dim -2 (the delta rule's dk x dk).
        mesh: the 1-D CP mesh.
        layout: the split (a name or a `Layout`); `seq_len`: the global sequence length.
        kind: "diagonal" or "matrix".
        meter: counts the summary bytes: an all-gather of `(P-1) x most x (transition + final
            elements per run) x element size` per rank, `most` the largest number of runs a
            rank holds that their document continues (2 under zigzag, 1 contiguous), and the
            same again in the backward's reduce-scatter.

    Returns:
        `(R, *state)` in `final`'s dtype (composed in at least float32), zero at a document
        start; differentiable w.r.t. `final` and `transition` on every rank.

    Raises:
        ValueError: on every rank, if any rank's input is invalid or the ranks' inputs differ.
    """
    cp = CPGroup.from_mesh(mesh)
    split, error = seq_layout(layout, cp, seq_len)
    runs = len(split.runs(cp.rank, seq_len)) if split is not None and error is None else -1
    error = error or _summary_error(final, transition, kind, runs)
    grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (final, transition))
    # R differs between ranks in a pack: the signature holds the per-run shapes only.
    signature = layout_fields(
        split, getattr(final, "dtype", None), grad,
        ("final", shape_of(final)[1:]), ("transition", shape_of(transition)[1:]),
    ) + [("kind", KINDS.index(kind) if kind in KINDS else -1), ("seq_len", seq_len if isinstance(seq_len, int) else -1)]
    device = final.device if isinstance(final, Tensor) else torch.device("cpu")
    agree(cp, error, signature, what="cp_initial_states", device=device)
    assert split is not None
    return initial_states(final, transition, cp=cp, layout=split, seq_len=seq_len, kind=kind, meter=meter)


def initial_states(
    final: Tensor, transition: Tensor, *, cp: CPGroup, layout: Layout, seq_len: int, kind: Kind,
    meter: CommMeter | None = None,
) -> Tensor:
    """`cp_initial_states` on arguments already checked and agreed (for the package's own recurrences)."""
    return post_summaries(final, transition, cp=cp, layout=layout, seq_len=seq_len, meter=meter).states(kind)


class PostedSummaries:
    """The summaries' all-gather in flight: `states(kind)` waits for it and composes each run's initial state.

    Posting first lets a caller run the work that does not need the states (the runs that
    start a document, the zero-state passes) while the summaries travel. The gathered
    table enters autograd only once it has arrived (`_Gathered`, whose backward is the
    reduce-scatter).
    """

    def __init__(self, final: Tensor, transition: Tensor, cp: CPGroup, layout: Layout, seq_len: int,
                 meter: CommMeter | None, carried: list[list[int]] | None = None, early: bool = False) -> None:
        self.final, self.transition, self.cp, self.meter = final, transition, cp, meter
        self.every = [layout.runs(r, seq_len) for r in range(cp.world)]
        self.sent = continued_runs(self.every) if carried is None else carried
        self.most = max(map(len, self.sent))
        self.summary: Tensor | None = None
        self.table: Tensor | None = None
        self.pending = None
        self.anchor: Tensor | None = None
        self.waited_s = 0.0  # how long `states` blocked on the all-gather (the part of it not hidden)
        if self.most == 0:  # no rank sends a row (every rank knows): nothing moves
            return
        mine = torch.tensor(self.sent[cp.rank], dtype=torch.long, device=final.device)
        summary = torch.cat([transition.reshape(final.shape[0], -1), final.reshape(final.shape[0], -1)], dim=1)
        # `most` rows from every rank, as all-gather needs
        self.summary = F.pad(summary[mine], (0, 0, 0, self.most - len(mine))).contiguous()
        self.pending = start_all_gather(self.summary.detach(), cp, meter)
        # `early`: the reduce-scatter's node enters autograd now (`_Anchor`), the data once it has arrived (`_Join`)
        self.anchor = _Anchor.apply(self.summary, cp, meter, cp.world) if early else None

    def arrived(self) -> Tensor | None:
        """Every rank's rows (`world x most`), in autograd once (blocks until they have arrived); None if none."""
        if self.pending is not None and self.table is None:
            start = time.perf_counter()
            arrived = self.pending.wait()
            self.waited_s = time.perf_counter() - start
            self.table = (_Gathered.apply(self.summary, arrived, self.cp, self.meter) if self.anchor is None
                          else _Join.apply(self.anchor, arrived))
        return self.table

    def states(self, kind: Kind) -> Tensor:
        """The state entering each of this rank's runs (blocks until the summaries have arrived)."""
        return compose_posted([self], kind)


def compose_posted(parts: list[PostedSummaries], kind: Kind) -> Tensor:
    """The state entering each of this rank's runs from the summaries of one or more gathers (each run's
    summary in one of them; a run no gather carries is never read). Blocks until all have arrived."""
    first = parts[0]
    final, transition, world = first.final, first.transition, first.cp.world
    tables = [(p, t) for p in parts if (t := p.arrived()) is not None]
    if not tables:
        return final.new_zeros(final.shape)
    width, acc = transition[0].numel(), accumulation_dtype(final.dtype)
    table = torch.cat([t.reshape(world * p.most, -1) for p, t in tables])
    trans = table[..., :width].to(acc).reshape(len(table), *transition.shape[1:])
    ends = table[..., width:].to(acc).reshape(len(table), *final.shape[1:])
    rows: dict[tuple[int, int], int] = {}
    offset = 0
    for p, _ in tables:
        rows.update({(r, i): offset + r * p.most + k for r, runs in enumerate(p.sent) for k, i in enumerate(runs)})
        offset += world * p.most
    inits = _compose(trans, ends, rows, first.every, first.cp.rank, kind)
    return _Tie.apply(inits.to(final.dtype), table)


def post_summaries(
    final: Tensor, transition: Tensor, *, cp: CPGroup, layout: Layout, seq_len: int, meter: CommMeter | None = None,
    carried: list[list[int]] | None = None, early: bool = False,
) -> PostedSummaries:
    """Start the all-gather of this rank's summaries (`final`, `transition`: one row per run, as
    `cp_initial_states` takes them); `.states(kind)` later waits and composes.

    `carried`: per rank, the runs whose summaries this gather carries (the same list on every
    rank; default: every run a later run continues). Two gathers that split those runs between
    them are composed together by `compose_posted`.

    `early`: the gather's reduce-scatter enters autograd now rather than when the data has
    arrived (`_Anchor`), so in the backward it waits until the work computed after this point
    has run its backward (a blocking collective runs when it is the latest-created node ready).
    """
    return PostedSummaries(final, transition, cp, layout, seq_len, meter, carried, early)


def continued_runs(every: list[list[Run]]) -> list[list[int]]:
    """Per rank, its runs that a later run of their document continues: the only summaries anyone reads."""
    last: dict[int, int] = {}
    for runs in every:
        for run in runs:
            last[run.doc] = max(last.get(run.doc, run.pos), run.pos)
    return [[i for i, run in enumerate(runs) if run.pos != last[run.doc]] for runs in every]


def _compose(
    trans: Tensor, ends: Tensor, rows: dict[tuple[int, int], int], every: list[list[Run]], rank: int, kind: str,
) -> Tensor:
    """The state entering each of `rank`'s runs, from the summaries (run i of rank r: row `rows[r, i]`).

    Only documents this rank continues (it holds a run past their first) are walked,
    from their first run to this rank's last one, and all of them at once: step k
    applies the k-th run of every such document, so the cost is a few ops per run
    of the longest chain, however many documents a pack holds.
    """
    chains: dict[int, list[tuple[int, int, int, int]]] = {}  # document -> (position, table row, rank, run)
    for r, runs in enumerate(every):
        for i, run in enumerate(runs):
            chains.setdefault(run.doc, []).append((run.pos, rows.get((r, i), -1), r, i))
    walks: list[list[int]] = []  # per document walked: the table rows of the runs to apply, in order
    ready: dict[int, tuple[int, int]] = {}  # local run -> (walk, step after which its initial state is ready)
    for doc in dict.fromkeys(run.doc for run in every[rank]):
        chain = sorted(chains[doc])
        mine = [k for k, (_, _, r, _) in enumerate(chain) if r == rank and k > 0]
        for k in mine:
            ready[chain[k][3]] = (len(walks), k - 1)
        if mine:
            walks.append([row for _, row, _, _ in chain[: max(mine)]])
    state_shape = ends.shape[1:]
    zero = ends.new_zeros((1, *state_shape))
    if not walks:
        return zero.expand(len(every[rank]), *state_shape)
    # Shorter walks end with steps of a zero row: states after a walk's end are never read.
    trans, ends = torch.cat([trans, torch.zeros_like(trans[:1])]), torch.cat([ends, zero])
    steps = max(map(len, walks))
    order = torch.tensor([w + [len(trans) - 1] * (steps - len(w)) for w in walks], device=trans.device).T
    state, states = zero.expand(len(walks), *state_shape), []
    for applied in order:
        t, e = trans[applied], ends[applied]
        state = t * state + e if kind == "diagonal" else t @ state + e
        states.append(state)
    table = torch.cat([zero, torch.stack(states).flatten(0, 1)])  # row 1 + k * walks + w: after step k of walk w
    index = [1 + ready[i][1] * len(walks) + ready[i][0] if i in ready else 0 for i in range(len(every[rank]))]
    return table[torch.tensor(index, device=table.device)]
