"""Any chunked recurrence kernel under CP: one pass over each stretch of this rank's tokens, the states passed.

A state-space or linear-attention layer's kernel (Mamba2's chunk scan, the gated delta
rule, ...) maps `(inputs of a stretch of tokens, initial state) -> (outputs, final state)`,
and its final state is affine in its initial one: `final = T(init) + final_0`. So:

1. this rank's runs are merged into stretches (consecutive runs of one document held in
   order, as zigzag's two middle chunks are: one kernel call instead of two, and no
   transition between them), and the stretches a later run continues go through the
   kernel first, from a zero state: their `final_0` and, where they continue a document
   themselves, `T` (a diagonal decay the caller computes from the inputs, or a matrix);
2. their summaries' all-gather is posted, and the work that does not depend on it (every
   other stretch's zero-state pass) runs while it travels; then each stretch's true
   initial state is composed in global order (`states.post_summaries`, float32 or wider,
   zero at a document start);
3. a stretch that continues a document gets its exact outputs: by a `Correction` where the
   outputs are affine in the initial state (scalar or diagonal decays: `o_t += (q_t * b_t) h0`,
   one product per token, no second pass), else by a rerun from its true state (a stretch
   no later run continues skips its zero-state pass then: it runs once, from the true state).

With `defer` (a kernel whose correction costs more than a plain pass: the delta rule's),
the summaries travel in two gathers: first those of every rank's first stretch, then the
rest; a stretch whose true initial state the first settles waits for it and runs once,
plainly, from that state (`stretch_plan.phased_stretches`). Every rank makes both gathers,
in that order (a gather no rank has a row for is skipped by all: the layout says so).

Exact by construction, whatever the kernel (transformers' torch reference, or mamba-ssm /
flash-linear-attention when installed). Gradients flow back through step 3, the composition
and the all-gather to every rank's summaries. `plan` tells the caller which stretches
continue a document and which are continued before any kernel call, so a kernel can
compute in its one pass what the correction and the summary will ask of it (the delta
rule's transition and corrected readout, `cpcompose.mixers.fla`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.agreement import CallSpec, Field
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layouts import Layout, LayoutSpec
from cpcompose.mixers._checks import agreed, layout_fields, local_layout
from cpcompose.mixers.states import Kind, compose_posted, continued_runs, post_summaries, tie
from cpcompose.mixers.stretch_plan import Stretch, phased_stretches, stretches

__all__ = ["Correction", "RunKernel", "Stretch", "cp_chunked_recurrence", "stretches", "token_pieces"]

Template = tuple[tuple[torch.Size, torch.dtype], tuple[torch.Size, torch.dtype]]
"""A call's summary rows, per run: (final state's shape, dtype), (transition's shape, dtype)."""

RunKernel = Callable[[slice, Tensor | None], tuple[Tensor, Tensor | None]]
"""`(local rows of one stretch, its initial state or None for zero) -> (its outputs, its final state)`; the final
state may be None (and the initial state is None, but for a `deferred` stretch) when the caller gives a `Correction`."""


@dataclass(frozen=True)
class Correction:
    """In place of a rerun, where the outputs are affine in the initial state: what the true initial state adds."""

    final: Callable[[slice], Tensor]
    """A stretch's final state from a zero state (asked only of the stretches a later run continues)."""
    apply: Callable[[slice, Tensor, Tensor], Tensor]
    """`(rows, the stretch's outputs from a zero state, its true initial state) -> its exact outputs`."""


def token_pieces(spans: Sequence[Stretch], *tensors: Tensor, dim: int = 1) -> dict[int, tuple[Tensor, ...]]:
    """Each stretch's rows of `tensors` (tokens on `dim`), keyed by its first local row, cut by one `split` per tensor.

    Not one slice per stretch: a slice's backward writes its gradient into a zero tensor of the whole shard, one
    per stretch and per use, then sums them; a split's backward is one concatenation. (Measured on Mamba2's SSD
    at P = 2: the zero fills and sums were a tenth of a rank's CP overhead.)
    """
    if len(spans) == 1:  # the whole shard: the tensors themselves (a split's backward would copy the gradient)
        return {spans[0].rows.start: tensors}
    sizes = [span.rows.stop - span.rows.start for span in spans]
    cut = [t.split(sizes, dim=dim) for t in tensors]
    return {span.rows.start: tuple(parts[i] for parts in cut) for i, span in enumerate(spans)}


def _identity(template: Tensor, kind: Kind) -> Tensor:
    """The transition that leaves a state unchanged, shaped like `template`."""
    if kind == "diagonal":
        return torch.ones_like(template)
    return torch.eye(template.shape[-1], dtype=template.dtype, device=template.device).expand_as(template).clone()


def cp_chunked_recurrence(
    kernel: RunKernel,
    transition: Callable[[slice], Tensor],
    *,
    mesh: DeviceMesh,
    layout: LayoutSpec,
    seq_local: int,
    kind: Kind,
    out_dim: int,
    what: str,
    device: torch.device,
    dtype: torch.dtype,
    grad: bool,
    signature: Sequence[Field] = (),
    caller_error: str | None = None,
    meter: CommMeter | None = None,
    correction: Correction | None = None,
    plan: Callable[[Sequence[Stretch]], None] | None = None,
    defer: bool = False,
) -> Tensor:
    """The recurrence's outputs over this rank's shard, exact over the global sequence.

    Args:
        kernel: runs one local run (see `RunKernel`); outputs have the run's tokens on `out_dim`.
        transition: a run's `T` for `kind` ("diagonal": `final = T * init + final_0`;
            "matrix": `final = T @ init + final_0` on the state's dim -2), with the batch
            dims of the state.
        mesh, layout: the CP mesh and the split; `seq_local`: this rank's tokens.
        out_dim: the outputs' token dim (they are concatenated along it in local order).
        what, device, dtype, grad: for the agreement (its name, where its tensor lives, the
            inputs' dtype, whether a backward will run: it communicates, so all ranks must).
        signature: the caller's own fields every rank must share (its shapes).
        caller_error: the caller's complaint about this call, raised on every rank.
        meter: counts the summaries' bytes.
        correction: where the outputs are affine in the initial state (or the kernel takes
            none): the final states and exact outputs come from here, not from a rerun.
        plan: called once with this rank's stretches, before any kernel call.
        defer: run the stretches that one gather of the ranks' first stretches settles
            plainly from their true initial state, after it, and gather the rest's summaries
            in a second gather (`stretch_plan.phased_stretches`): for a kernel whose
            correction costs more than a plain pass. `kernel` is then given those
            stretches' true initial states, and returns their true final states.

    Raises:
        ValueError: on every rank, before any state moves, if any rank's input is invalid
            or the ranks' calls differ.
    """
    cp = CPGroup.from_mesh(mesh)
    split, error = local_layout(layout, cp, seq_local)
    fields = [*layout_fields(split, dtype, grad), ("kind", ("diagonal", "matrix").index(kind)),
              ("defer", int(defer)), *signature]
    posted: list[Template] = []  # the summaries' per-run templates, once posted (for `spec`)

    def run() -> Tensor:
        assert split is not None
        return _recurrence(kernel, transition, cp, split, seq_local, kind, out_dim, grad, meter, correction, plan,
                           defer, posted)

    def spec() -> CallSpec:
        assert split is not None
        return CallSpec((), dtype, device, functools.partial(_replay_gathers, split, seq_local, defer, device, posted))

    return agreed(cp, caller_error or error, fields, what=what, cached_as="chunked_recurrence", device=device,
                  spec=spec, run=run)


def _phases(split: Layout, seq_len: int, rank: int, defer: bool
            ) -> tuple[list[Stretch], list[list[Stretch]] | None, list[list[int]]]:
    """This rank's stretches, every rank's for two phases (or None: one gather), and every rank's continued runs."""
    every = [split.runs(r, seq_len) for r in range(split.world)]
    sent_all = continued_runs(every)
    starts = {run.doc: run.pos for run in split.global_runs(seq_len)}
    spans = stretches(every[rank], starts, set(sent_all[rank]))
    phased = phased_stretches(every, starts, sent_all) if defer and any(sent_all) else None
    if phased is not None and not any(s.deferred for ranks in phased for s in ranks):
        phased = None  # nothing would wait for a first gather (every rank knows): one gather
    return (phased[rank] if phased is not None else spans), phased, sent_all


def _carried(phased: Sequence[Sequence[Stretch]], sent_all: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """The two gathers' rows: per gather, per rank, its continued runs in (then out of) its first stretch."""
    return [[[i for i in sent if (i in ranks[0].runs) == first] for sent, ranks in zip(sent_all, phased)]
            for first in (True, False)]


def _replay_gathers(split: Layout, seq_local: int, defer: bool, device: torch.device, posted: list[Template],
                    cp: CPGroup) -> None:
    """The recurrence's forward collectives on zeros (what a rank that deviates from this call posts): its one or
    two summary gathers, of the sizes the call posted (`posted` holds its per-run templates)."""
    seq_len = seq_local * cp.world
    _, phased, sent_all = _phases(split, seq_len, cp.rank, defer)
    if not any(sent_all) or not posted:
        return
    runs = len(split.runs(cp.rank, seq_len))
    zeros = [torch.zeros((runs, *shape), dtype=dtype, device=device) for shape, dtype in posted[0]]
    for carried in ([None] if phased is None else _carried(phased, sent_all)):
        post_summaries(*zeros, cp=cp, layout=split, seq_len=seq_len, carried=carried).arrived()


def _recurrence(
    kernel: RunKernel, transition: Callable[[slice], Tensor], cp: CPGroup, split: Layout, seq_local: int, kind: Kind,
    out_dim: int, grad: bool, meter: CommMeter | None, correction: Correction | None,
    plan: Callable[[Sequence[Stretch]], None] | None, defer: bool, posted: list[Template],
) -> Tensor:
    """`cp_chunked_recurrence` once every rank agreed (its arguments, checked)."""
    seq_len = seq_local * cp.world
    spans, phased, sent_all = _phases(split, seq_len, cp.rank, defer)
    sent = sent_all[cp.rank]
    if plan is not None:
        plan(spans)
    outputs: dict[int, Tensor] = {}
    finals: dict[int, Tensor] = {}

    def run_stretch(k: int, summarize: bool, init: Tensor | None = None) -> None:
        out, end = kernel(spans[k].rows, init)
        outputs[k] = out
        if summarize:
            finals[k] = correction.final(spans[k].rows) if correction is not None else end
            assert finals[k] is not None, "a kernel without a Correction must return its final state"

    if not any(sent_all):  # every run is a whole document (every rank knows): nothing moves
        for k in range(len(spans)):
            run_stretch(k, False)
        return _joined([outputs[k] for k in range(len(spans))], out_dim)
    if phased is not None:
        inits = _two_phases(spans, phased, run_stretch, sent_all, finals, transition, kind, grad, cp=cp,
                            layout=split, seq_len=seq_len, meter=meter, rerun=correction is None, posted=posted)
    else:
        inits = _one_phase(spans, sent, run_stretch, finals, transition, kind, grad, cp=cp, layout=split,
                           seq_len=seq_len, meter=meter, rerun=correction is None, posted=posted)
    exact = []
    for k, span in enumerate(spans):  # 3. the true initial state's contribution
        init = inits[span.runs[0]]
        if not span.continues or span.deferred:
            exact.append(outputs[k])
        elif correction is not None:
            exact.append(correction.apply(span.rows, outputs[k], init))
        else:
            exact.append(kernel(span.rows, init)[0])
    return tie(_joined(exact, out_dim), inits)


def _joined(pieces: list[Tensor], dim: int) -> Tensor:
    """The stretches' outputs in local order (one stretch: itself, not a concatenation's copy)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _one_phase(
    spans: Sequence[Stretch], sent: Sequence[int], run_stretch: Callable[..., None], finals: dict[int, Tensor],
    transition: Callable[[slice], Tensor], kind: Kind, grad: bool, *, cp: CPGroup, layout: Layout, seq_len: int,
    meter: CommMeter | None, rerun: bool, posted: list[Template],
) -> Tensor:
    """One gather: the continued stretches first, their summaries posted, the rest while they travel."""
    for k, span in enumerate(spans):  # 1. the summaries first: every rank waits for them
        if span.continued:
            run_stretch(k, True)
    if not finals:  # this rank sends placeholders only: their shapes are a final state's
        run_stretch(0, True)
    summaries = _summaries(spans, sent, finals, transition, kind, grad)
    _keep_templates(posted, *summaries)
    gather = post_summaries(*summaries, cp=cp, layout=layout, seq_len=seq_len, meter=meter)
    for k, span in enumerate(spans):  # 2. what needs no initial state, while the summaries travel
        if k not in finals and (not rerun or not span.continues):
            run_stretch(k, False)
    inits = gather.states(kind)
    if meter is not None:
        meter.note_wait("all_gather", gather.waited_s)
    return inits


def _keep_templates(posted: list[Template], ends: Tensor, trans: Tensor) -> None:
    """Remember the summaries' per-run shapes and dtypes once, for the call's replay on zeros (`_replay_gathers`)."""
    if not posted:
        posted.append(((ends.shape[1:], ends.dtype), (trans.shape[1:], trans.dtype)))


def _two_phases(
    spans: Sequence[Stretch], phased: Sequence[Sequence[Stretch]], run_stretch: Callable[..., None],
    sent_all: Sequence[Sequence[int]], finals: dict[int, Tensor], transition: Callable[[slice], Tensor], kind: Kind,
    grad: bool, *, cp: CPGroup, layout: Layout, seq_len: int, meter: CommMeter | None, rerun: bool,
    posted: list[Template],
) -> Tensor:
    """Two gathers (`stretch_plan.phased_stretches`): the first stretch's summaries, then the deferred stretches
    from their true states and every other summary. Every rank makes both, in this order."""
    carried = _carried(phased, sent_all)
    sent = sent_all[cp.rank]
    run_stretch(0, True)  # phase 1 (its final state also gives the placeholders' shapes)
    summaries = _summaries(spans, sent, finals, transition, kind, grad, {0})
    _keep_templates(posted, *summaries)
    # In the backward, a rank whose other stretches do not read the first gather (zigzag's rank 0) runs their
    # backward before joining its reduce-scatter, which its peers join only after their deferred stretches'.
    first = post_summaries(*summaries, cp=cp, layout=layout, seq_len=seq_len, meter=meter, carried=carried[0],
                           early=True)
    for k, span in enumerate(spans[1:], 1):  # what needs no initial state, while the first gather travels
        if not span.deferred and (span.continued or not rerun or not span.continues):
            run_stretch(k, span.continued)
    early = first.states(kind)
    for k, span in enumerate(spans):  # settled by the first gather: from the true state, once
        if span.deferred:
            run_stretch(k, span.continued, early[span.runs[0]])
    ends, trans = _summaries(spans, sent, finals, transition, kind, grad, set(range(1, len(spans))))
    table = first.arrived()  # in the backward, the second gather's reduce-scatter comes first on every rank
    second = post_summaries(ends if table is None else tie(ends, table), trans, cp=cp, layout=layout,
                            seq_len=seq_len, meter=meter, carried=carried[1])
    inits = compose_posted([first, second], kind)
    if meter is not None:
        meter.note_wait("all_gather", first.waited_s + second.waited_s)
    return inits


def _summaries(
    spans: Sequence[Stretch], sent: Sequence[int], finals: dict[int, Tensor], transition: Callable[[slice], Tensor],
    kind: Kind, grad: bool, carried: set[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Per run of this rank, `(final_0, T)` rows for an all-gather (only the continued runs' are read, and of
    those only the runs of the stretches `carried` names, all by default).

    A stretch's summary goes on its last run; its other runs get the identity and a zero
    state (the composition then carries the stretch's initial state to its last run
    unchanged). A stretch that starts its document needs no transition (its initial state
    is zero): a zero placeholder, which needs a gradient when a backward runs, as every
    placeholder does (a rank must join the summaries' reduce-scatter in its backward). So
    does a deferred stretch: its final state is already its true one.
    """
    carried = set(range(len(spans))) if carried is None else carried
    k0 = next(iter(finals))
    final_t = finals[k0]
    if kind == "matrix":  # (..., d, dv) -> (..., d, d): every rank's rows alike, whether it has a T or not
        trans_t = final_t.new_zeros((*final_t.shape[:-1], final_t.shape[-2]))
    else:
        trans_t = transition(spans[k0].rows)
    zero_f, zero_t = (torch.zeros_like(t).requires_grad_(grad) for t in (final_t, trans_t))
    identity = _identity(trans_t, kind).requires_grad_(grad)
    rows: dict[int, tuple[Tensor, Tensor]] = {}
    for k, span in enumerate(spans):
        if k not in carried:
            continue
        for i in span.runs[:-1]:
            rows[i] = (zero_f, identity)
        if span.continued:
            mapped = span.continues and not span.deferred
            rows[span.runs[-1]] = (finals[k], transition(span.rows).expand_as(trans_t) if mapped else zero_t)
    count = sum(len(span.runs) for span in spans)
    read = set(sent) & set(rows)  # the others are never read: placeholders
    ends = torch.stack([rows[i][0] if i in read else zero_f for i in range(count)])
    trans = torch.stack([rows[i][1] if i in read else zero_t for i in range(count)])
    return ends, trans
