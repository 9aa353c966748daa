"""A mixture-of-experts layer's routed part under expert parallelism: each choice to its expert's rank and back.

`routed_experts` on one process sorts a token's `top_k` choices by expert and runs every expert locally. Under
expert parallelism (EP) the `num_experts` experts are dealt to the `ep` ranks of a group in contiguous blocks
(rank r holds `[r * E/ep, (r + 1) * E/ep)`), and each rank routes only its own tokens (its batch rows, its CP
shard of the sequence, or both). Here each routed (token, choice) pair becomes one row, the rows go to their
experts' ranks (comm's token dispatch: the counts, then the rows), the local experts run on what arrived
(`grouped_experts`, the received per-expert counts as its groups), the results come back in the caller's order
(comm's combine), and each token's choices are weighed and summed as `sum_weighted_choices` does on
one process: in the promoted dtype of the results and the routing weights, cast to the results' dtype.

One agreement per call: the layer checks its input once (dispatch's checks, this rank's block, the row width
the experts read) and every rank agrees on the verdict and on what both exchanges need equal (the expert count,
the row and result widths, the dtype) in one tiny all-gather; then it posts comm's exchanges directly
(`dispatch_to_experts`, `combine_from_experts`). The results it sends home are its own: one per received row,
the experts' hidden width, the rows' dtype, so combine needs no agreement of its own (`combine` would add a
second all-gather per layer). Host syncs per call: the agreement, and dispatch's counts (plus, on CUDA, the
routed pairs and the index range).

A choice at or past `num_experts` routes nowhere (transformers' EP sentinel, Zaya's skip expert): it is not
sent and adds nothing. Every rank calls this for every layer, even with no routed choice (its experts then run
on no rows, so their weights still get zero gradients and the backward's exchanges still match).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from cpcompose.agreement import Signature, agree_across_ranks
from cpcompose.comm import CommMeter, CPGroup, combine_from_experts, dispatch_error, dispatch_to_experts, rehearsing
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
        ValueError: on every rank, before any row moves, if any rank's `local` is not its block
            (`num_experts / group.world` experts), its `hidden` is not as wide as its experts, or its input is
            bad (dispatch's checks), or the ranks' expert counts, widths or dtypes differ.
    """
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    # flat (token, choice) pairs that go to an expert; in a rehearsal (no values to read) every one does
    pairs = (torch.arange(len(flat), device=flat.device) if rehearsing()
             else torch.nonzero(flat < num_experts).squeeze(1))
    # Each `top_k x tokens x hidden` copy is let go as soon as the next one exists (the step's peak: the
    # profile's `Moe.dispatch`); what backward needs autograd keeps. transformers casts the rows to the weights' dtype.
    rows = hidden[pairs // top_k].to(local.gate_up.dtype)
    expert_of_row = flat[pairs]
    error = None
    if local.num_experts * group.world != num_experts:
        error = (f"this rank holds {local.num_experts} experts; {num_experts} experts over {group.world} EP ranks "
                 f"are {num_experts / group.world:g} each")
    elif hidden.shape[-1] != local.hidden:
        error = f"hidden states of width {hidden.shape[-1]} for experts of hidden size {local.hidden}"
    error = error or dispatch_error(rows, expert_of_row, num_experts=num_experts, world=group.world)
    signature = (Signature().int("num_experts", num_experts).int("row width", rows.shape[-1])
                 .int("result width", local.hidden).dtype("dtype", rows.dtype))
    agree_across_ranks(group, error, signature.fields, what="expert-parallel experts", device=rows.device)
    dispatched = dispatch_to_experts(rows, expert_of_row, num_experts=num_experts, group=group, meter=meter)
    del rows
    counts = torch.tensor(dispatched.expert_counts, dtype=torch.int64)
    out = grouped_experts(dispatched.rows, counts, local, activation=activation, kernel=kernel)
    if post is not None:
        out = post(out)
    # one row per received row, `local.hidden` wide, in the rows' dtype on every rank: what the agreement fixed
    back = combine_from_experts(out, dispatched)
    del out, dispatched
    dtype = back.dtype
    full = _PlaceRows.apply(back, pairs, tokens * top_k)
    del back
    weighted = full.view(tokens, top_k, full.shape[-1]) * top_k_weights.unsqueeze(-1)
    del full
    return weighted.sum(dim=1).to(dtype).to(hidden.dtype)
