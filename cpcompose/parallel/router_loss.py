"""A mixture-of-experts router's load-balancing loss, exact when the tokens are split over ranks.

The Switch-Transformer loss (transformers' `load_balancing_loss_func`) is a product of two statistics over
every token of the batch: the share of top-k assignments each expert gets (`f_e`, counted, no gradient) and
the mean router probability of each expert (`P_e`):  loss = E * sum_e f_e * P_e. Computed on one CP rank's
shard it is a different number (each rank's experts look balanced or not on its own tokens), which is what a
trainer gets by calling the model's own loss under CP.

Here the counts and the number of tokens are summed over the group first (no gradient flows through them),
and each rank returns  E * sum_e f_e * (its own probability sum)_e / N: the shares add up to exactly the
loss one process computes on the whole batch, and so do their gradients, which need no collective of their
own; like `cp_cross_entropy`'s shares, the parameter gradients are summed over the group afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CPGroup, all_reduce

__all__ = ["cp_load_balancing_loss"]


def cp_load_balancing_loss(router_logits: Sequence[Tensor], *, num_experts: int, top_k: int, mesh: DeviceMesh,
                           valid: Tensor | None = None) -> Tensor:
    """This rank's share of the load-balancing loss over every token of `mesh` (1-D: the dp x cp mesh in
    training, the tokens one process would see in one micro-step).

    Args:
        router_logits: one `(tokens, num_experts)` tensor per MoE layer, this rank's tokens (in any order: the
            loss is a sum over tokens).
        valid: `(tokens,)` 1 for a token that counts, 0 for padding (transformers' `attention_mask`); None: all.
    Returns:
        A 0-d tensor; the shares of the ranks sum to transformers' `load_balancing_loss_func` over all tokens
        (in the logits' dtype, at least float32, where transformers computes in float32).
    """
    dtype = torch.promote_types(router_logits[0].dtype, torch.float32)
    weight = None if valid is None else valid.reshape(-1).to(dtype)
    counts = torch.zeros(num_experts, dtype=dtype, device=router_logits[0].device)
    prob_sum = torch.zeros(num_experts, dtype=dtype, device=router_logits[0].device)
    rows = torch.zeros((), dtype=dtype, device=router_logits[0].device)
    for logits in router_logits:
        probs = F.softmax(logits.to(dtype), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        each = torch.ones_like(chosen, dtype=dtype) if weight is None else weight.repeat_interleave(top_k)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen, each)
        prob_sum = prob_sum + (probs if weight is None else probs * weight[:, None]).sum(dim=0)
        rows = rows + (probs.shape[0] if weight is None else weight.sum())
    totals = torch.cat([counts.detach(), rows.detach()[None]])
    all_reduce(totals, CPGroup.from_mesh(mesh).group, op="sum")  # f_e and N over every token: no gradient
    global_counts, global_rows = totals[:-1], totals[-1]
    return num_experts * torch.sum(global_counts / global_rows * prob_sum / global_rows)
