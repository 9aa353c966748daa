"""Every family the transformers integration supports, in bfloat16 under CP at P = 2 and 4, as close to float64
as one process in bfloat16 is.

A bfloat16 run is not exact on one process either, so the yardstick is the single-process
bfloat16 run's own error against the float64 run of the same weights (`bf16_cases`): CP rounds
the same operations in another order (its merges and carried states in float32 or wider), so
its error is of the same size, plus the rounding of what it adds (each rank's share of a
gradient rounded to bfloat16 once). Errors are norms over every logit and every gradient
entry, which thousands of roundings make stable (CP / one process measured 0.8-1.25 over every
family and batch here, with ATEN_CPU_CAPABILITY=avx2 too). Each family runs a plain batch
(zigzag: "ring" at P = 2, "allgather" at P = 4) and a packed row of
documents (`pack_batch`, "alltoall" at P = 2; reference: each document alone), at P = 2 with
the first-use probe on, as a user's first step runs (at P = 4 off: it was half the run's
time). Families whose routers or indexers pick a top-k run with every expert and key chosen
(a choice near a tie flips under any reordering of bfloat16 roundings), and the families'
weights make what crosses a rank boundary outweigh bfloat16's rounding, so that a dropped
state or halo fails (`bf16_cases`). Rank 0's results are compared: losses and gradients are
summed over the ranks and the logits gathered, the same on every rank.
"""

from __future__ import annotations

import torch

from tests.support import bf16_cases as cases
from tests.support.tolerance import ULPS

UNIT = torch.finfo(torch.bfloat16).eps / 2  # bfloat16's unit roundoff: one rounding moves a value by at most this
FLOAT32 = torch.finfo(torch.float32).eps
LOSS_TERMS = cases.BATCH * cases.SEQ + cases.VOCAB  # the loss's float32 sums: over tokens, and logsumexp's
SPREAD = 2.0
# CP error <= SPREAD x one-process error (+ UNIT x ||sum over ranks of |share||| on gradients); loss error <= twice
# the logits' largest error (cross-entropy is logsumexp(z) - z[target]) + ULPS x eps(float32) x terms x |loss|.
STRATEGIES = {2: {"plain": "ring", "packed": "alltoall"}, 4: {"plain": "allgather"}}


def _failures(results: dict, references: dict, world: int) -> list[str]:
    found = []
    for (name, kind), got in results.items():
        reference, at = references[name, kind], f"{name} {kind} P={world}"
        one, cp = reference["one_process"], cases.errors(got, reference["float64"])
        bounds = {
            "logits": SPREAD * one["logits"],
            "grads": SPREAD * one["grads"] + UNIT * got["shares"] / cp["grads_norm"],
            "loss": 2 * cp["logits_max"] + ULPS * FLOAT32 * LOSS_TERMS * cp["loss_value"],
        }
        found += [f"{at} {what}: CP {cp[what]:.2e} > {bound:.2e} (one process {one[what]:.2e})"
                  for what, bound in bounds.items() if not cp[what] <= bound]
    return found


def test_every_family_in_bfloat16_is_within_one_process_error(pools) -> None:
    """Loss, logits and every gradient of each family; xLSTM's mLSTM kernels failed in bfloat16 before."""
    two = pools.get(2).run(cases.bf16_runs, STRATEGIES[2], True, True)  # the probe on; the references computed
    four = pools.get(4).run(cases.bf16_runs, STRATEGIES[4], False, False)  # the probe was half this run's time
    references = {key: ref for rank in two for key, ref in rank["references"].items()}
    assert set(two[0]["cp"]) == set(references) == {(n, "plain") for n in cases.FAMILIES} | {
        (n, "packed") for n in cases.PACKED}
    assert set(four[0]["cp"]) == {(n, "plain") for n in cases.FAMILIES}
    failures = _failures(two[0]["cp"], references, 2) + _failures(four[0]["cp"], references, 4)
    assert not failures, "\n".join(failures)
