"""Activation checkpointing inside `context_parallel`: the recomputation must be CP attention too.

`loss.backward()` inside a CP region runs with the region's TorchFunctionMode off the
stack (a mode is popped while its own handler runs), so a checkpointed block
recomputed during the backward would call plain SDPA on a shard.
`recompute_context`, checkpoint's `context_fn`, re-enters the region around the
recomputation. float64, derived tolerance (support/plain_model.TOL): only summation order differs.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from cpcompose import context_parallel, cp_cross_entropy
from cpcompose.parallel import recompute_context
from tests.support.plain_model import SEQ, TOL, finish, make_batch, make_model, reference
from tests.support.tolerance import assert_close


def checkpointed_step(mesh, with_context: bool) -> dict | str:
    model = make_model(True)
    for block in model.blocks:
        forward = block.forward
        kwargs = {"context_fn": recompute_context} if with_context else {}
        block.forward = lambda x, f=forward: checkpoint(f, x, use_reentrant=False, **kwargs)
    tokens, labels = make_batch()
    positions = torch.arange(SEQ)
    try:
        with context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 0]):
            loss = cp_cross_entropy(model(tokens, positions), labels, mesh=mesh)
            loss.backward()
    except Exception as e:  # noqa: BLE001 - the failure without the context is checkpoint's own error
        return f"{type(e).__name__}: {e}"
    return finish(model, loss, mesh)


def test_recompute_context_keeps_checkpointed_attention_exact(pools) -> None:
    want = reference(True)
    for got in pools.get(2).run(checkpointed_step, True):
        assert_close(got["loss"], want["loss"], **TOL)
        for name, grad in want["grads"].items():
            assert_close(got["grads"][name], grad, **TOL)


def test_without_recompute_context_the_recomputation_is_not_cp(pools) -> None:
    """The hazard itself: without the context the recomputed attention differs from the forward's."""
    for got in pools.get(2).run(checkpointed_step, False):
        assert isinstance(got, str) and "Recomputed values" in got, got
