"""The microbatches a pipeline schedule keeps in flight, read from torch's own action order.

A stage holds a microbatch's activations from its forward until its backward has run: for a zero-bubble schedule's
split backward, until the weight part ("W") has run too (torch's `stage_backward_input` keeps the autograd graph
for it). torch 2.13's schedules expose every rank's order (`pipeline_order`: forwards "F", full backwards "B", input
and weight backwards "I" / "W", DualPipeV's "OVERLAP_F_B" of a forward and a backward); replaying one rank's order
and counting, per stage, the forwards whose backward has not finished gives how many microbatches that rank holds
at each moment. Nothing here is a per-schedule number: a schedule torch changes changes the counts with it.

The orders are made by constructing torch's schedule class on stand-in stages (the few attributes its constructor
reads: stage index, stage count, group size and rank), so no process group or model is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace

from torch import nn

from cpcompose.distributed.pipeline import PIPELINE_SCHEDULES, SINGLE_STAGE_SCHEDULES, stage_ids

__all__ = ["Moment", "Occupancy", "occupancy", "schedule_order"]


@cache
def schedule_order(schedule: str, pp: int, per_rank: int, microbatches: int) -> dict[int, tuple[tuple[str, int, int],
                                                                                                 ...]]:
    """Each pipeline rank's compute actions in torch's order, as (kind, stage, microbatch), kind one of "F", "B",
    "I", "W" (an overlapped forward and backward listed as its forward, then its backward).

    Raises:
        ValueError: an unknown schedule, or one torch refuses for these counts (its message).
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"parallelism.pp_schedule: {schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
    cls = PIPELINE_SCHEDULES[schedule]
    n = pp * (1 if schedule in SINGLE_STAGE_SCHEDULES else per_rank)
    stages = [SimpleNamespace(stage_index=s, num_stages=n, group_size=pp, group_rank=0, is_first=s == 0,
                              is_last=s == n - 1, submod=nn.Module())
              for s in stage_ids(schedule, pp, 0, 1 if schedule in SINGLE_STAGE_SCHEDULES else per_rank)]
    try:
        made = cls(stages[0] if schedule in SINGLE_STAGE_SCHEDULES else stages, microbatches, loss_fn=_no_loss)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise ValueError(f"parallelism.pp_schedule: torch's {cls.__name__} refuses pp = {pp}, {per_rank} stage(s) "
                         f"per rank, {microbatches} microbatches: {e}") from None
    if schedule in SINGLE_STAGE_SCHEDULES:  # its `pipeline_order` is a drawing (torch 2.13's 1F1B one is off by
        # one on the last ranks); what runs is `_step_microbatches`: record each rank's calls to a stand-in stage
        return {rank: _run_single(cls, pp, rank, microbatches) for rank in range(pp)}
    return {rank: tuple(_compute(actions)) for rank, actions in made.pipeline_order.items()}


class _Recorder(SimpleNamespace):
    """A stand-in stage that records the schedule's compute calls and has no communication."""

    def get_fwd_recv_ops(self, *_: object) -> list:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, i: int, *_: object, **__: object) -> None:
        self.calls.append(("F", self.stage_index, i))

    def backward_one_chunk(self, i: int, *_: object, full_backward: bool = True, **__: object) -> None:
        self.calls.append(("B" if full_backward else "I", self.stage_index, i))

    def backward_weight_one_chunk(self, i: int, *_: object, **__: object) -> None:
        self.calls.append(("W", self.stage_index, i))

    def perform_reduce_grad(self, *_: object) -> None:
        return None


def _run_single(cls: type, pp: int, rank: int, microbatches: int) -> tuple[tuple[str, int, int], ...]:
    stage = _Recorder(stage_index=rank, num_stages=pp, group_size=pp, group_rank=rank, is_first=rank == 0,
                      is_last=rank == pp - 1, submod=nn.Module(), has_backward=True, calls=[])
    schedule = cls(stage, microbatches, loss_fn=_no_loss)
    schedule._initialize_stage = lambda *_, **__: None  # no shapes to infer: nothing runs
    schedule._step_microbatches([()] * microbatches, [{}] * microbatches, [None] * microbatches, None)
    return tuple(stage.calls)


def _no_loss(output: object, target: object) -> object:  # the schedule is never run: it needs a loss to plan backwards
    return output


def _compute(actions: list) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    for a in actions:
        if a is None:
            continue
        kind = a.computation_type.value
        if a.sub_actions:  # DualPipeV's overlapped forward and backward: torch runs the forward first
            out += _compute(list(a.sub_actions))
        elif kind in ("F", "B", "I", "W"):
            out.append((kind, a.stage_index, a.microbatch_index))
    return out


@dataclass(frozen=True)
class Moment:
    """One compute action of a rank's order, and what the rank holds while it runs (per stage, in `Occupancy.stages`'
    order)."""

    kind: str
    """"F", "B", "I" or "W"."""
    stage: int
    """The stage it runs on."""
    in_flight: tuple[int, ...]
    """Microbatches forwarded whose backward has not finished, this action's own counted."""
    forwards: tuple[int, ...]
    """Forwards run so far this step, this one included."""
    backwards: tuple[int, ...]
    """Backwards that made weight gradients ("B", "W") so far, not this one."""
    inputs: tuple[int, ...]
    """Input-gradient backwards ("I") so far, not this one."""
    outputs: tuple[int, ...]
    """Microbatches forwarded whose output-gradient backward ("B" or "I") has not finished, this action's own
    counted: the ones whose outputs a stage still holds (torch's stage drops a last stage's logits there)."""


@dataclass(frozen=True)
class Occupancy:
    """What one rank holds over its order."""

    stages: tuple[int, ...]
    """The rank's stages."""
    moments: tuple[Moment, ...]
    """One per compute action, in order."""

    def most(self, stage: int) -> int:
        """The most microbatches `stage` ever holds at once."""
        i = self.stages.index(stage)
        return max(m.in_flight[i] for m in self.moments)


def occupancy(schedule: str, pp: int, per_rank: int, microbatches: int, pp_rank: int) -> Occupancy:
    """Replay pipeline rank `pp_rank`'s order of `schedule`: a microbatch is in flight on a stage from its forward
    until its backward ("B"), or its weight backward ("W") after a split one, has run."""
    order = schedule_order(schedule, pp, per_rank, microbatches)[pp_rank]
    stages = tuple(sorted({s for _, s, _ in order}))
    held: dict[int, set[int]] = {s: set() for s in stages}
    outputs: dict[int, set[int]] = {s: set() for s in stages}
    done = {k: dict.fromkeys(stages, 0) for k in "FBI"}
    moments = []
    for kind, stage, mb in order:
        if kind == "F":
            held[stage].add(mb)
            outputs[stage].add(mb)
            done["F"][stage] += 1
        moments.append(Moment(kind, stage, *(tuple(x[s] for s in stages) for x in (
            {s: len(held[s]) for s in stages}, done["F"], done["B"], done["I"],
            {s: len(outputs[s]) for s in stages}))))
        if kind in ("B", "I"):
            outputs[stage].discard(mb)
        if kind in ("B", "W"):
            held[stage].discard(mb)
            done["B"][stage] += 1
        elif kind == "I":
            done["I"][stage] += 1
    return Occupancy(stages, tuple(moments))
