"""How a rank's runs become kernel calls ("stretches"), in one phase of state passing or two.

`stretches`: consecutive runs of one document that a rank holds in order are one kernel
call (zigzag's two middle chunks: no transition between them).

`phased_stretches`, two phases: the stretches whose true initial state the first gather
already settles. A kernel that can only be corrected at a price (the delta rule's widened pass costs a
value width dv + dk, `cpcompose.mixers.fla`) is cheaper run once, plainly, from its true
initial state, when that state is known early. It is, after one all-gather, for a stretch
every predecessor run of whose document lies in some rank's first stretch: each rank runs
its first stretch (phase 1) and posts its summaries; the stretches that summary settles
("deferred") wait for it and run plainly from their true state; every other stretch runs
as before while the gather travels, and its summary goes out in a second gather with the
deferred ones' (a true final state, transition zero).

Under zigzag this is the middle rank's second chunk: its pair is split (chunk P-1 in phase
1, chunk P deferred) instead of merged, so it widens L/(2P) tokens instead of L/P. A rank's
first stretch is split off only where that defers the rest; nothing else changes, so no
rank ever widens more tokens than with one gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from cpcompose.layouts import Run

__all__ = ["Stretch", "phased_stretches", "stretches"]


@dataclass(frozen=True)
class Stretch:
    """Consecutive runs of one document that this rank holds in order: one kernel call."""

    rows: slice  # its local rows
    runs: tuple[int, ...]  # its runs' indices in `layout.runs(rank)`
    continues: bool  # it does not start its document: its initial state comes from earlier runs
    continued: bool  # a later run of its document (on any rank) starts from its final state
    deferred: bool = False  # it waits for the first of two gathers and runs from its true state (`phased_stretches`)


def stretches(runs: Sequence[Run], starts: dict[int, int], continued: set[int]) -> list[Stretch]:
    """`runs` (one rank's, in local order) merged where a run follows the previous one in its document and rows."""
    groups: list[list[int]] = []
    for i, run in enumerate(runs):
        prev = runs[groups[-1][-1]] if groups else None
        adjacent = prev is not None and prev.doc == run.doc and prev.pos + prev.length == run.pos \
            and prev.row + prev.length == run.row
        if adjacent:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [Stretch(slice(runs[g[0]].row, runs[g[-1]].row + runs[g[-1]].length), tuple(g),
                    runs[g[0]].pos != starts[runs[g[0]].doc], g[-1] in continued) for g in groups]


def phased_stretches(every: Sequence[Sequence[Run]], starts: dict[int, int], sent: Sequence[Sequence[int]]
                     ) -> list[list[Stretch]]:
    """Every rank's stretches for two phases (its first stretch is phase 1; `deferred` marks what waits for it).

    Args:
        every: every rank's runs, in local order; `starts`: each document's first position.
        sent: per rank, its runs that a later run continues (`states.continued_runs`).
    """
    merged = [stretches(runs, starts, set(s)) for runs, s in zip(every, sent)]
    heads = [_split_head(spans, every[r], set(sent[r])) for r, spans in enumerate(merged)]
    phase1 = {(r, i) for r, spans in enumerate(heads) for i in spans[0].runs}
    phased = []
    for r, spans in enumerate(heads):
        marked = [spans[0]] + [replace(s, deferred=_settled(s, r, every, phase1)) for s in spans[1:]]
        split = len(spans) > len(merged[r])
        if split and not marked[1].deferred:  # splitting the first stretch defers nothing: keep it whole
            marked = [merged[r][0]] + [replace(s, deferred=_settled(s, r, every, phase1)) for s in merged[r][1:]]
        phased.append(marked)
    return phased


def _split_head(spans: list[Stretch], runs: Sequence[Run], sent: set[int]) -> list[Stretch]:
    """`spans` with the first stretch's first run apart from its other runs, where it continues a document
    (a first stretch that starts its document runs plainly anyway)."""
    first = spans[0]
    if not first.continues or len(first.runs) == 1:
        return spans
    head, rest = first.runs[0], first.runs[1:]
    end = runs[rest[-1]].row + runs[rest[-1]].length
    return [Stretch(slice(first.rows.start, runs[head].row + runs[head].length), (head,), True, True),
            Stretch(slice(runs[rest[0]].row, end), rest, True, rest[-1] in sent), *spans[1:]]


def _settled(span: Stretch, rank: int, every: Sequence[Sequence[Run]], phase1: set[tuple[int, int]]) -> bool:
    """Whether `span` continues a document all of whose runs before it lie in phase-1 stretches."""
    if not span.continues:
        return False
    first = every[rank][span.runs[0]]
    before = [(r, i) for r, runs in enumerate(every) for i, run in enumerate(runs)
              if run.doc == first.doc and run.pos < first.pos]
    return all(key in phase1 for key in before)
