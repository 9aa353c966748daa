"""Hugging Face hybrid models (state-space, linear-attention and short-convolution layers) exact under CP.

Loss and every gradient equal transformers' own single-process run, at P = 2 under each attention
strategy and at P = 4 under one (a family's turn), on a zigzag-split batch and on a packed row of documents
(`pack_batch`), at the tolerance each family's kernels allow (`hybrid_cases`). With transformers'
activation checkpointing at its defaults (non-reentrant, no `context_fn`) the recomputation runs in
the forward's CP region (`cphf.checkpointing`), so it is exact too, reentrant included.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import hybrid_cases as cases
from tests.support.tolerance import assert_close

NAMES = sorted(cases.HYBRIDS)
WITH_ATTENTION = [n for n in NAMES if cases.HYBRIDS[n].attention]


def _strategies(name: str, world: int) -> tuple[str, ...] | None:
    """Every strategy at P = 2 (None: `hybrid_cases`' default); at P = 4 one per family with attention, the
    families taking the strategies in turn. The strategies differ in attention only, which
    tests/integrations/test_transformers.py runs under each at P = 4; a mixer's CP is the same under all."""
    if world == 2 or name not in WITH_ATTENTION:
        return None
    return (cases.STRATEGIES[WITH_ATTENTION.index(name) % len(cases.STRATEGIES)],)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_hybrid_is_exact(pools, name: str, world: int) -> None:
    want, state = cases.reference_plain(name)
    got = pools.get(world).run(cases.cp_plain, name, state, _strategies(name, world))
    cases.assert_matches(want, got, name, f"P={world} plain")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_hybrid_packed_documents_are_exact(pools, name: str, world: int) -> None:
    want, state = cases.reference_packed(name)
    got = pools.get(world).run(cases.cp_packed, name, state, _strategies(name, world))
    cases.assert_matches(want, got, name, f"P={world} packed")


@pytest.mark.parametrize("name", NAMES)
def test_checkpointing_with_transformers_defaults_is_exact(pools, name: str) -> None:
    """`activation_checkpointing_enable()` (= the deprecated `gradient_checkpointing_enable()`) as transformers
    sets it up: before, a layer ending in a routed mixer (Mamba2, Mamba, LFM2, RecurrentGemma, xLSTM, MiniMax)
    recomputed outside the region and failed in torch ("a different number of tensors was saved")."""
    want, state = cases.reference_plain(name)
    got = pools.get(2).run(cases.cp_plain, name, state, ("alltoall",), {})
    cases.assert_matches(want, got, name, "P=2 checkpointed")


@pytest.mark.parametrize("name", ["mamba2", "lfm2"])
def test_reentrant_checkpointing_is_exact(pools, name: str) -> None:
    """`use_reentrant=True` recomputes with no error to see: it would have been silently single-process."""
    want, state = cases.reference_plain(name)
    got = pools.get(2).run(cases.cp_plain, name, state, ("alltoall",), {"use_reentrant": True})
    cases.assert_matches(want, got, name, "P=2 reentrant checkpointed")


@pytest.mark.parametrize("name", [n for n in NAMES if cases.HYBRIDS[n].attention])
def test_outside_a_region_the_model_is_transformers_own(name: str) -> None:
    """The same "cpcompose" model on one process, with no CP region, computes what transformers' own attention does
    (gpt-oss's sinks included, which transformers' sdpa path would drop)."""
    ids, _ = cases.plain_batch()
    with cases.one_thread():  # two intra-op threads on two shared cores spin: Falcon-H1 took 6 s, 0.1 s on one
        reference = cases.build(name, cp=False)
        model = cases.build(name, reference.state_dict())
        assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **cases.FLOAT64)
