"""FSDP2 over dp_shard x cp (HSDP when dp_replicate > 1), for any model whose blocks are named."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from cpcompose.distributed.parallel_dims import ParallelDims, flat_mesh

__all__ = ["apply_fsdp"]


def apply_fsdp(model: nn.Module, blocks: Iterable[nn.Module], *, mesh: DeviceMesh, parallel_dims: ParallelDims) -> None:
    """Shard ``model`` with ``fully_shard``: one unit per block, then the root for what is left.

    CP ranks hold the same parameters but see different tokens, so sharding over
    dp_shard x cp also sums their gradients: no separate cp reduction is needed.
    Gradients are summed, never averaged: ``cp_cross_entropy`` already divides by
    the global token count, so each rank's loss is its share of the global mean.

    Args:
        model: the (possibly cut) model; its parameters outside ``blocks`` go to the root unit.
        blocks: the submodules to shard one by one (e.g. transformer blocks), in forward order.
        mesh: the root mesh from ``parallel_dims.build_mesh(...)``.
        parallel_dims: the degrees; with pp > 1 blocks stay unsharded between microbatches.
    """
    dp_mesh = flat_mesh(mesh, "dp_shard_cp")
    if parallel_dims.dp_replicate_enabled:
        # HSDP: replicate outer, shard inner. torch 2.13 warns that slicing a flattened dim
        # "will be deprecated" but has no public alternative; the slice creates no new groups.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
            dp_mesh = mesh["dp_replicate", "dp_shard_cp"]
    # With PP, each block runs once per microbatch: keep it unsharded between them.
    reshard = not parallel_dims.pp_enabled
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already a share of the global mean: sum, don't average. Plain SUM
            # also avoids PREMUL_SUM, which gloo lacks (FSDP would pick it for fp32/bf16).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
