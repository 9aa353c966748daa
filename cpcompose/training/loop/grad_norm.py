"""Gradient clipping by the global norm over every mesh.

Gradients may be plain tensors (replicated), FSDP or TP DTensors on different
meshes, and, with pipelining, on different stages. Squares of the local shards are
summed per mesh and all-reduced over that mesh (one scalar per mesh dim), and the
stages' squares over the pipeline group, so every rank clips with the same global
norm.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from cpcompose.comm import all_reduce

__all__ = ["clip_grad_norm", "global_grad_norm"]


def global_grad_norm(parameters: Iterable[nn.Parameter], *, pp_group: dist.ProcessGroup | None = None,
                     expert_parameters: Iterable[nn.Parameter] = (),
                     ep_group: dist.ProcessGroup | None = None) -> Tensor:
    """The 2-norm of all gradients of the model (all stages), as a plain float32 tensor.

    Parameters are grouped by the mesh the PARAMETER lives on, in the order the meshes first
    appear among all parameters (with or without a gradient): every rank then reduces over the
    same meshes in the same order, even where a gradient is None on some ranks only.
    `expert_parameters` (among `parameters`) hold a different block of experts on each rank of
    `ep_group` (expert parallelism): their squares are summed over that group too.
    """
    params = list(parameters)
    device = next((p.grad.device for p in params if p.grad is not None),
                  next((p.device for p in params), torch.device("cpu")))
    split = {id(p) for p in expert_parameters}
    total = _squares([p for p in params if id(p) not in split], device)
    if split:
        experts = _squares([p for p in params if id(p) in split], device)
        if ep_group is not None:
            all_reduce(experts, ep_group)
        total = total + experts
    if pp_group is not None:
        all_reduce(total, pp_group)
    return total.sqrt()


def _squares(params: list[nn.Parameter], device: torch.device) -> Tensor:
    """The sum of the squares of `params`' gradients over every mesh they live on."""
    by_mesh: dict[object, list[Tensor]] = {}
    for p in params:
        group = by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, [])
        if p.grad is not None:
            group.append(p.grad)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for mesh, group in by_mesh.items():
        if mesh is None:  # plain tensors: replicated, every rank has them whole
            total += sum(g.float().pow(2).sum() for g in group)
            continue
        # Sum squares of the local shards, then over every mesh dim; a replicated dim holds
        # the same shard on each of its ranks, so divide its copies out.
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for g in group:
            copies = 1
            for size, placement in zip(mesh.shape, g.placements):
                copies *= size if placement.is_replicate() else 1
            squares += g.to_local().float().pow(2).sum() / copies
        for dim in range(mesh.ndim):
            if mesh.size(dim) > 1:
                all_reduce(squares, mesh.get_group(dim))
        total += squares
    return total


def clip_grad_norm(
    parameters: Iterable[nn.Parameter], max_norm: float, *, pp_group: dist.ProcessGroup | None = None,
    expert_parameters: Iterable[nn.Parameter] = (), ep_group: dist.ProcessGroup | None = None,
) -> float:
    """Scale gradients so their global norm is at most `max_norm` (<= 0: leave them); returns the norm
    before clipping, which is measured either way for the log. `expert_parameters`, `ep_group`: as
    `global_grad_norm` takes them."""
    params = list(parameters)
    norm = global_grad_norm(params, pp_group=pp_group, expert_parameters=expert_parameters,
                            ep_group=ep_group).item()
    coef = max_norm / (norm + 1e-6)
    if 0 < coef < 1.0:  # max_norm <= 0 would zero (or flip) every gradient
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
