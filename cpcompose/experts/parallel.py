"""A mixture-of-experts layer's routed part under expert parallelism: each choice to its expert's rank and back.

`routed_experts` on one process sorts a token's `top_k` choices by expert and runs every expert locally. Under
expert parallelism (EP) the `num_experts` experts are dealt to the `ep` ranks of a group in contiguous blocks
(rank r holds `[r * E/ep, (r + 1) * E/ep)`), and each rank routes only its own tokens (its batch rows, its CP
shard of the sequence, or both). Here each routed (token, choice) pair becomes one row, the rows go to their
experts' ranks (`dispatch`: the counts, then the rows, every rank's input agreed first), the local experts run
on what arrived (`grouped_experts`, the received per-expert counts as its groups), the results come back in the
caller's order (`combine`), and each token's choices are weighed and summed as `sum_weighted_choices` does on
one process: in the promoted dtype of the results and the routing weights, cast to the results' dtype.

A choice at or past `num_experts` routes nowhere (transformers' EP sentinel, Zaya's skip expert): it is not
sent and adds nothing. Every rank calls this for every layer, even with no routed choice (its experts then run
on no rows, so their weights still get zero gradients and the backward's exchanges still match).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from cpcompose.comm import CommMeter, CPGroup, rehearsing
from cpcompose.experts.dispatch import combine, dispatch
from cpcompose.experts.grouped import ExpertKernel, grouped_experts
from cpcompose.experts.weights import ExpertWeights

__all__ = ["parallel_routed_experts"]


class _PlaceRows(torch.autograd.Function):
    """`rows` placed at `index` of `(n, width)` zeros; the backward gathers the gradient's rows at `index`.

    `Tensor.index_copy` computes the same, but its autograd keeps its `source` (the combined expert outputs,
    `top_k x tokens x hidden`) alive until backward for that tensor's shape alone: one more routed copy of the
    hidden states per MoE layer than the experts path of transformers saves (found by counting the saved tensors
    in a rehearsal, docs/trainer/memory.md). Here only `index` is kept."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, index: Tensor, n: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        return rows.new_zeros(n, rows.shape[-1]).index_copy_(0, index, rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def parallel_routed_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, local: ExpertWeights, *,
                            num_experts: int, group: CPGroup, activation: Callable[[Tensor], Tensor],
                            post: Callable[[Tensor], Tensor] | None = None, kernel: ExpertKernel = "auto",
                            meter: CommMeter | None = None) -> Tensor:
    """`routed_experts` with the experts split over `group`'s ranks: a collective every rank calls.

    Args:
        hidden: `(tokens, hidden)` this rank's tokens (any count, 0 included).
        top_k_index: `(tokens, top_k)` global expert indices (`>= num_experts`: routed nowhere).
        top_k_weights: `(tokens, top_k)` their weights.
        local: this rank's block of experts, `num_experts / group.world` of them: experts
            `[group.rank * n, (group.rank + 1) * n)`, in that order.
        num_experts: the global expert count, the same on every rank.
        group: the EP group.
        activation, post, kernel: as `routed_experts` takes them.
        meter: counts the bytes this rank sends.

    Returns:
        `(tokens, hidden)` in `hidden`'s dtype, what `routed_experts` with every expert gives on one process.

    Raises:
        ValueError: on every rank, before any row moves, if `local` is not this rank's block
            (`num_experts / group.world` experts) or any rank's input is bad (dispatch's checks).
    """
    if local.num_experts * group.world != num_experts:
        raise ValueError(f"this rank holds {local.num_experts} experts; {num_experts} experts over {group.world} "
                         f"EP ranks are {num_experts / group.world:g} each")
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    # flat (token, choice) pairs that go to an expert; in a rehearsal (no values to read) every one does
    pairs = (torch.arange(len(flat), device=flat.device) if rehearsing()
             else torch.nonzero(flat < num_experts).squeeze(1))
    # Each `top_k x tokens x hidden` copy is let go as soon as the next one exists (the step's peak: the
    # profile's `Moe.dispatch`); what backward needs autograd keeps. transformers casts the rows to the weights' dtype.
    dispatched = dispatch(hidden[pairs // top_k].to(local.gate_up.dtype), flat[pairs], num_experts=num_experts,
                          group=group, meter=meter)
    counts = torch.tensor(dispatched.expert_counts, dtype=torch.int64)
    out = grouped_experts(dispatched.rows, counts, local, activation=activation, kernel=kernel)
    if post is not None:
        out = post(out)
    back = combine(out, dispatched)
    del out, dispatched
    dtype = back.dtype
    full = _PlaceRows.apply(back, pairs, tokens * top_k)
    del back
    weighted = full.view(tokens, top_k, full.shape[-1]) * top_k_weights.unsqueeze(-1)
    del full
    return weighted.sum(dim=1).to(dtype).to(hidden.dtype)
