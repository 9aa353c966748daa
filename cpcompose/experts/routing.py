"""From a router's choices to rows sorted by expert and back: the local half of a token dispatch.

A router gives each token `top_k` experts and weights. `sort_by_expert` orders the (token, choice) pairs by
expert, `routed_experts` runs them through `grouped_experts` and `sum_weighted_choices` adds each token's weighted outputs
back together, as transformers' experts modules do (`grouped_mm_experts_forward`). Expert parallelism puts an
exchange between the sort and the experts, and its reverse before the weighted sum; the two ends stay these.

A choice of an index at or past `num_experts` routes nowhere (an expert-parallel sentinel, Zaya's skip
expert): it is sorted after every real one, computed by no expert and adds nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cpcompose.experts.grouped import ExpertKernel, grouped_experts
from cpcompose.experts.weights import ExpertWeights

__all__ = ["ExpertOrder", "routed_experts", "sort_by_expert", "sum_weighted_choices"]


@dataclass(frozen=True)
class ExpertOrder:
    """The (token, choice) pairs of one routing, sorted by expert."""

    pairs: Tensor
    """`(tokens * top_k,)`: flat pair indices `token * top_k + choice` in expert order (stable within an expert),
    pairs routed nowhere last."""
    counts: Tensor
    """`(experts,)` int64: the pairs each expert gets."""
    routed: int
    """The pairs routed to an expert (`counts.sum()`, read once on the host)."""
    top_k: int


def sort_by_expert(top_k_index: Tensor, num_experts: int) -> ExpertOrder:
    """The pairs of `top_k_index` `(tokens, top_k)` ordered by expert, and each expert's count."""
    flat = top_k_index.reshape(-1)
    _, pairs = torch.sort(flat, stable=True)
    nowhere = flat.clamp(0, num_experts)  # every index past the last expert counts in one extra bin, dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, nowhere, torch.ones_like(nowhere))[:num_experts]
    return ExpertOrder(pairs, counts, int(counts.sum()), top_k_index.shape[-1])


def sum_weighted_choices(expert_rows: Tensor, order: ExpertOrder, top_k_weights: Tensor) -> Tensor:
    """Each token's expert outputs times its routing weights, summed over its choices: `(tokens, hidden)`.

    The product and the sum run in the promoted dtype of the rows and the weights (a float32 router's weights
    with bfloat16 rows: float32), the result in the rows' dtype, as transformers' experts forward does.
    """
    tokens, top_k = top_k_weights.shape
    full = expert_rows.new_zeros(tokens * top_k, expert_rows.shape[-1])
    full = full.index_copy(0, order.pairs[:order.routed], expert_rows)
    weighted = full.view(tokens, top_k, full.shape[-1]) * top_k_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(expert_rows.dtype)


def routed_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, experts: ExpertWeights, *,
                   activation: Callable[[Tensor], Tensor], post: Callable[[Tensor], Tensor] | None = None,
                   kernel: ExpertKernel = "auto") -> Tensor:
    """A mixture-of-experts layer's routed part on one process: sort, `grouped_experts`, the weighted sum of the choices.

    Args:
        hidden: `(tokens, hidden)`.
        top_k_index: `(tokens, top_k)` expert indices (`>= num_experts`: routed nowhere).
        top_k_weights: `(tokens, top_k)` their weights.
        experts, activation, kernel: as `grouped_experts` takes them.
        post: a row-wise step after the second projection, before the weights (a post-expert norm), or None.

    Returns:
        `(tokens, hidden)` in `hidden`'s dtype.
    """
    order = sort_by_expert(top_k_index, experts.num_experts)
    rows = hidden[order.pairs[:order.routed] // order.top_k]
    out = grouped_experts(rows, order.counts, experts, activation=activation, kernel=kernel)
    if post is not None:
        out = post(out)
    return sum_weighted_choices(out, order, top_k_weights).to(hidden.dtype)
