"""The router's load-balancing loss over tokens split across ranks equals transformers' on one process.

Reference: transformers' own `load_balancing_loss_func` (Qwen3-MoE's, the Switch-Transformer loss every MoE
family in transformers shares) on every token at once, float64 logits. It rounds the router probabilities to
float32 where cpcompose keeps float64, so the two agree to float32's rounding: relative 1e-6 (a few float32
ulps of a sum over E = 8 experts of products of two means), far below what each rank's own statistics give
(their mean misses by over 100 times that on these 24 random tokens; asserted too, so the case can fail).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from cpcompose.parallel.router_loss import cp_load_balancing_loss

E, K, T, LAYERS = 8, 2, 24, 3
REL = 1e-6


def _inputs() -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(T, E, generator=g, dtype=torch.float64) * 2 for _ in range(LAYERS)]
    valid = (torch.rand(T, generator=g) > 0.25).to(torch.float64)
    return logits, valid


def _reference(masked: bool) -> tuple[float, list[torch.Tensor]]:
    logits, valid = _inputs()
    leaves = [x.clone().requires_grad_() for x in logits]
    loss = load_balancing_loss_func(tuple(leaves), E, K, valid[None] if masked else None)
    loss.backward()
    return loss.item(), [x.grad for x in leaves]


def shares(mesh, masked: bool) -> dict:  # noqa: ANN001
    rank, world = mesh.get_local_rank(), mesh.size()
    logits, valid = _inputs()
    rows = torch.arange(T)[rank::world]  # any split: the loss is a sum over tokens
    leaves = [x[rows].clone().requires_grad_() for x in logits]
    share = cp_load_balancing_loss(leaves, num_experts=E, top_k=K, mesh=mesh, valid=valid[rows] if masked else None)
    share.backward()
    alone = load_balancing_loss_func(tuple(x.detach() for x in leaves), E, K, valid[rows][None] if masked else None)
    return {"rows": rows, "share": share.item(), "grads": [x.grad for x in leaves], "alone": float(alone)}


@pytest.mark.parametrize("masked", [False, True], ids=["all-tokens", "padding"])
def test_the_shares_add_up_to_the_loss_of_one_process(pools, masked: bool) -> None:
    loss, grads = _reference(masked)
    results = pools.get(2).run(shares, masked)
    total = sum(r["share"] for r in results)
    assert abs(total - loss) <= REL * abs(loss), (total, loss)
    for r in results:
        for got, want in zip(r["grads"], grads):
            scale = want.abs().max().item()
            assert torch.allclose(got, want[r["rows"]], rtol=0, atol=REL * scale)
    naive = sum(r["alone"] for r in results) / len(results)  # each rank's own statistics, averaged
    assert abs(naive - loss) > 100 * REL * abs(loss), "the shards' own losses would have passed: a weak case"
