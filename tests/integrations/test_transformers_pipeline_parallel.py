"""Hugging Face Llama, Qwen3 and Qwen3-Next at pp = 2 x cp = 2 under every pipeline schedule equal one process.

Each family (4 layers, float64; Qwen3-Next alternating Gated DeltaNet and gated attention, MoE MLPs) is cut into
this rank's stages (one per rank under GPipe and 1F1B, two otherwise: looped, or a V under ZBVZeroBubble and
DualPipeV) and run by torch's schedule with 4 microbatches, each stage's forward in a CP region of its own and
activation checkpointing recomputing inside it (`tests/support/pipeline_cases.py`). The loss and every gradient
equal transformers on one process over the whole batch. One pool launch runs every case.

Tolerance (tests/support/tolerance.py): float64's epsilon x the longest reduction (a weight gradient sums over
tokens x width = 128 x 64 terms) x the reference's magnitude (each gradient at the model's largest); Qwen3-Next
computes its norms and delta rule in float32 inside the float64 model: float32's epsilon x the tokens (128).
"""

from __future__ import annotations

import functools

import torch

from tests.support import pipeline_cases as pc
from tests.support.tolerance import assert_close

FAMILIES = ("llama", "qwen3", "qwen3_next")
CASES = [(family, schedule) for family in FAMILIES for schedule in pc.SCHEDULES]


@functools.cache
def _references() -> tuple[dict[str, dict], dict[str, dict]]:
    wants, states = {}, {}
    for family in FAMILIES:
        wants[family], states[family] = pc.reference(family)
    return wants, states


def _tolerance(family: str) -> dict:
    if family == "qwen3_next":
        return {"terms": pc.ROWS * pc.SEQ, "dtype": torch.float32}
    return {"terms": pc.ROWS * pc.SEQ * 64}


def test_pp2_cp2_under_every_schedule_equals_one_process(pools) -> None:
    wants, states = _references()
    per_rank = pools.get(pc.PP * pc.CP).run(pc.pipeline_case, CASES, states, timeout=900)
    failures = []
    for family, schedule in CASES:
        want = wants[family]
        largest = max(g.abs().max().item() for g in want["grads"].values())
        held = set()
        for rank, results in enumerate(per_rank):
            got = results[family, schedule]
            at = f"{family} {schedule} rank {rank}"
            held |= set(got["held"])
            checks = [("loss", got["loss"], want["loss"], _tolerance(family))]
            checks += [(name, grad, want["grads"][name], {**_tolerance(family), "scale": largest})
                       for name, grad in got["grads"].items()]
            assert set(got["grads"]) == set(got["held"]), at
            for what, actual, expected, tol in checks:
                try:
                    assert_close(actual, expected, **tol)
                except AssertionError as e:
                    failures.append(f"{at} {what}: {str(e).splitlines()[0:3]}")
        assert held == set(want["grads"]), (family, schedule, set(want["grads"]) - held)
    assert not failures, "\n".join(failures)
