"""Compiled decoder layers of Hugging Face models under a CP region: exact, one graph each, no recompiles.

The trainer's compile (`apply_hf_compile`) on float64 Llama, Qwen3 and Gemma 2 (sliding and full layers,
a logit softcap: each layer's window is a constant of its op call) at cp=2 (ring), with `aot_eager`
(dynamo and AOTAutograd, what has to see around the custom op; inductor runs in the trainer's test,
tests/training/families/hf/test_compile.py): loss and every gradient equal the single-process float64 run
and the same model eager under CP at the derived float64 bound (only summation order differs). fullgraph=True
makes any graph break an error; every graph holds one `cpcompose::attention` call per attention it traced;
the second step, in a new region, runs with recompiles made errors. Llama also with activation
checkpointing (each layer's parts compiled inside the checkpoint, the recomputation in the region again).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import hf_cases as cases
from tests.support.hf_compile_cases import (OP, compiled_bad_positions, compiled_checkpoint_without_context,
                                            compiled_steps)
from tests.support.tolerance import assert_close

# Derived (tests/support/tolerance.py), float64: a weight gradient sums over batch x tokens x width (<= 64).
# Gemma 2 runs its RMSNorm in float32 by design: float32's bound over batch x tokens, at the largest gradient's
# scale (as tests/integrations/test_transformers.py holds its eager CP run).
TOL = dict(terms=cases.BATCH * cases.SEQ * 64)
FLOAT32_INSIDE = {"gemma2"}


def _same(got: dict, want: dict, what: str, family: str = "llama") -> None:
    tol = dict(terms=cases.BATCH * cases.SEQ, dtype=torch.float32) if family in FLOAT32_INSIDE else TOL
    scale = max(g.abs().max().item() for g in want["grads"].values()) if family in FLOAT32_INSIDE else None
    assert_close(got["loss"], want["loss"], **tol, msg=lambda m: f"{what} loss: {m}")
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        assert_close(got["grads"][name], grad, **tol, scale=scale, msg=lambda m, name=name: f"{what} {name}: {m}")


@pytest.mark.parametrize("name,checkpointed", [("llama", False), ("qwen3", False), ("gemma2", False), ("llama", True)])
def test_compiled_layers_are_exact(pools, name: str, checkpointed: bool) -> None:
    want, state = cases.reference_plain(name)
    for rank, got in enumerate(pools.get(2).run(compiled_steps, name, state, checkpointed)):
        _same(got["eager"], want, f"rank {rank} eager", name)
        for step, result in enumerate(got["steps"]):
            _same(result, want, f"rank {rank} compiled step {step}", name)
            _same(result, got["eager"], f"rank {rank} compiled step {step} vs eager", name)
        attention = [g for g in got["graphs"] if OP in g]
        assert attention and all(g.count(OP) == 1 for g in attention), "one CP attention op per traced attention"
        # whole layers: every graph is a layer's and holds its attention; checkpointed: the layers' parts
        assert checkpointed or len(attention) == len(got["graphs"]), got["graphs"]


def test_positions_checked_inside_the_compiled_op(pools) -> None:
    """Rank 1 alone gives positions numbered from 0: every rank raises from the op's agreement, naming rank 1's
    position_ids (a value dynamo cannot read without a graph break); the next valid step runs."""
    want, state = cases.reference_plain("llama")
    for got in pools.get(2).run(compiled_bad_positions, state):
        assert "rank 1" in got["error"] and "position_ids are not the positions" in got["error"], got["error"]
        _same(got["after"], want, "after the refusal")


def test_compiled_recomputation_outside_the_region_is_refused(pools) -> None:
    """Checkpointed layers whose compiled parts are recomputed outside the region (no `recompute_context`): every
    rank raises, naming the fix, while dynamo traces the recomputation (whether a backward runs is read once per
    trace, `_compat.in_backward`), as the eager attention does."""
    _, state = cases.reference_plain("llama")
    for error in pools.get(2).run(compiled_checkpoint_without_context, state):
        assert "recomputed outside its CP region" in error and "recompute_context" in error, error
