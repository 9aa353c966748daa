"""The microbatches a pipeline rank keeps in flight, read from torch's schedules (`memory.schedule`).

Each count is checked against the schedule's own theory where it has one: GPipe holds every microbatch; 1F1B's rank
r holds pp - r (its warm-up); Interleaved 1F1B's rank r holds its warm-up plus one, (v - 1) pp + 2 (pp - 1 - r) + 1
forwards of v stages (Megatron-LM's count, capped by the v m forwards there are); the zero-bubble schedules hold
what 1F1B's first rank does (2 pp half-stages for the V ones), DualPipeV one more (its overlapped forward runs before
its backward); LoopedBFS every microbatch on every stage.
"""

from __future__ import annotations

import pytest

from cpcompose.training.memory.schedule import occupancy, schedule_order, stage_ids


def _held(schedule: str, pp: int, m: int, v: int = 2) -> list[tuple[tuple[int, ...], int]]:
    """Per pipeline rank: the most microbatches each of its stages holds, and the most all together."""
    out = []
    for r in range(pp):
        occ = occupancy(schedule, pp, v, m, r)
        assert occ.stages == tuple(sorted(stage_ids(schedule, pp, r, 1 if schedule in ("GPipe", "1F1B") else v)))
        out.append((tuple(occ.most(s) for s in occ.stages), max(sum(x.in_flight) for x in occ.moments)))
    return out


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_single_stage_schedules_hold_what_their_theory_says(pp: int, m: int) -> None:
    assert _held("GPipe", pp, m) == [((m,), m)] * pp
    assert _held("1F1B", pp, m) == [((min(m, pp - r),), min(m, pp - r)) for r in range(pp)]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_interleaved_1f1b_holds_its_warm_up_plus_one(pp: int, m: int) -> None:
    totals = [total for _, total in _held("Interleaved1F1B", pp, m)]
    assert totals == [min(2 * m, (2 - 1) * pp + 2 * (pp - 1 - r) + 1) for r in range(pp)]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [8, 16])
def test_zero_bubble_and_looped_schedules(pp: int, m: int) -> None:
    assert [total for _, total in _held("ZBVZeroBubble", pp, m)] == [2 * pp] * pp
    assert [total for _, total in _held("InterleavedZeroBubble", pp, m)] == [2 * pp] * pp
    assert [total for _, total in _held("DualPipeV", pp, m)] == [2 * pp + 1] * pp
    assert _held("LoopedBFS", pp, m) == [((m, m), 2 * m)] * pp
    # the V's first rank holds its first stage's microbatches, its last stage one at a time
    assert _held("ZBVZeroBubble", pp, m)[0][0] == (pp * 2, 1)


@pytest.mark.parametrize("pp", [2, 4])
def test_the_last_stage_holds_its_logits_from_forward_to_backward(pp: int) -> None:
    """`Moment.outputs`: the microbatches whose output gradient ("B" or "I") has not run, what the trainer's last
    stage holds logits for (`return_outputs=False`): GPipe and LoopedBFS every microbatch, the others one; never more
    than in flight, the same as in flight without a split backward."""
    m, last = 8, {}
    for schedule, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2),
                        ("ZBVZeroBubble", 2), ("DualPipeV", 2), ("LoopedBFS", 2)):
        for r in range(pp):
            occ = occupancy(schedule, pp, v, m, r)
            for x in occ.moments:
                assert all(o <= f for o, f in zip(x.outputs, x.in_flight, strict=True))
                if schedule not in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
                    assert x.outputs == x.in_flight
            if pp * v - 1 in occ.stages:
                i = occ.stages.index(pp * v - 1)
                last[schedule] = max(x.outputs[i] for x in occ.moments)
    assert last == {"GPipe": m, "1F1B": 1, "Interleaved1F1B": 1, "InterleavedZeroBubble": 1, "ZBVZeroBubble": 1,
                    "DualPipeV": 1, "LoopedBFS": m}


def test_the_single_stage_orders_are_what_runs() -> None:
    """torch 2.13's `pipeline_order` drawing of 1F1B starts its last rank at microbatch 1; what `_step_microbatches`
    runs starts at 0, one forward then its backward."""
    last = schedule_order("1F1B", 4, 1, 4)[3]
    assert last[:4] == (("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1))


def test_an_impossible_schedule_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"^parallelism.pp_schedule: torch's ScheduleDualPipeV refuses pp = 4"):
        schedule_order("DualPipeV", 4, 2, 4)
    with pytest.raises(ValueError, match=r"^parallelism.pp_schedule: 'Zigzag' is not one of"):
        schedule_order("Zigzag", 2, 2, 4)
