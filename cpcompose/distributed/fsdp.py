"""FSDP2 over dp_shard x cp (HSDP when dp_replicate > 1), for any model whose blocks are named.

The units are torchtitan's: the input embedding alone, one unit per block, the final norm
and the output layer together, then the root for whatever is left. Every unit but the
last is resharded after its forward, so a large vocabulary's embedding is not held
gathered through the whole step; the last unit stays gathered because the backward
starts with it. Mixed precision is FSDP2's own (`MixedPrecisionPolicy`): each unit's
parameters are gathered in the compute dtype just before its forward and freed after,
the sharded float32 parameters are the optimizer's master weights, and gradients are
reduced in float32. No whole-model cast copy exists at any time.

One rank over dp x cp has nothing to shard with, yet two options need FSDP2 there and get it over a one-rank mesh
(`fsdp_wanted`): tensor parallelism (every parameter then a DTensor, which the fused AdamW needs) and
`training.offload_params` (FSDP2's CPUOffloadPolicy is the offload, so one GPU trains a model whose float32
parameters, gradients and AdamW state do not fit on it, as ZeRO-3 offload does on one rank).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from cpcompose.distributed.parallel_dims import ParallelDims, flat_mesh

__all__ = ["apply_fsdp", "fsdp_applied", "fsdp_wanted"]


def apply_fsdp(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    *,
    mesh: DeviceMesh,
    parallel_dims: ParallelDims,
    embedding: nn.Module | None = None,
    head: Sequence[nn.Module] = (),
    param_dtype: torch.dtype | None = None,
    offload_params: bool = False,
    experts: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
    roots: Sequence[nn.Module] = (),
) -> None:
    """Shard ``model`` with ``fully_shard``: the embedding, each block, the head, then the root.

    CP ranks hold the same parameters but see different tokens, so sharding over
    dp_shard x cp also sums their gradients: no separate cp reduction is needed.
    Gradients are summed, never averaged: ``cp_cross_entropy`` already divides by
    the global token count, so each rank's loss is its share of the global mean.

    Args:
        model: the (possibly cut) model; its parameters outside the units go to the root unit.
        blocks: the submodules to shard one by one (e.g. transformer blocks), in forward order.
        mesh: the root mesh from ``parallel_dims.build_mesh(...)``.
        parallel_dims: the degrees; with pp > 1 no unit is resharded between microbatches.
        embedding: the input embedding, its own unit (resharded after forward); None: in the root.
            An embedding whose weight the head shares (tied) must be left to the root.
        head: the final norm and the output layer, one unit kept gathered from its forward to its
            backward (the last to run forward, the first backward); empty: in the root.
        param_dtype: the dtype each unit's parameters are gathered in for compute (e.g. bfloat16);
            None keeps them float32. Sharded parameters (the optimizer's) and the gradient
            reduction stay float32 either way.
        offload_params: keep the sharded parameters, their gradients and so the optimizer state
            in host memory (FSDP2's ``CPUOffloadPolicy``); the optimizer step then runs on the CPU.
        experts: expert-parallel experts modules (each rank its own block of experts), one unit each, sharded
            over the experts' mesh ``efsdp`` axis (HSDP with ``dp_replicate``) instead of dp_shard x cp, before
            the blocks that hold them: so their gradients are summed over the ranks holding the same experts
            only (dispatch's backward already brought every EP rank's tokens to them), as torchtitan does.
        expert_mesh: the experts' mesh from ``parallel_dims.build_expert_mesh``; required with ``experts``.
        roots: with several pipeline stages per rank, each stage's module (sharing ``model``'s modules, as
            `cpcompose.distributed.pipeline_stage.StageModule` does): each is made an FSDP root of its own
            instead of ``model``, since a ``PipelineStage`` reduces a stage's gradients through its module's
            root state. ``model`` then must have no parameter outside the units.
    """
    shared = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    if shared & {id(p) for m in head for p in m.parameters()}:
        raise ValueError("apply_fsdp: the embedding and the head share a weight (tied embeddings); pass "
                         "embedding=None and head=() so the tied weight stays in the root unit")
    dp_mesh = flat_mesh(mesh, "dp_shard_cp")
    if parallel_dims.dp_replicate_enabled:
        # HSDP: replicate outer, shard inner. torch 2.13 warns that slicing a flattened dim
        # "will be deprecated" but has no public alternative; the slice creates no new groups.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
            dp_mesh = mesh["dp_replicate", "dp_shard_cp"]
    options = {
        "mesh": dp_mesh,
        # Without param_dtype every dtype stays the parameters' own (float64 tests reduce in float64).
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype,
                                          reduce_dtype=torch.float32 if param_dtype is not None else None),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params
        else OffloadPolicy(),
    }
    # With PP, each unit runs once per microbatch: keep it unsharded between them.
    reshard = not parallel_dims.pp_enabled
    if experts:
        if expert_mesh is None:
            raise ValueError("apply_fsdp: experts need expert_mesh (ParallelDims.build_expert_mesh)")
        names = ("dp_replicate", "efsdp") if parallel_dims.dp_replicate_enabled else ("efsdp",)
        for module in experts:
            fully_shard(module, reshard_after_forward=reshard, **(options | {"mesh": expert_mesh[names]}))
    if embedding is not None:
        fully_shard(embedding, reshard_after_forward=reshard, **options)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, **options)
    if head:
        fully_shard(list(head), reshard_after_forward=False, **options)
    for root in roots or (model,):
        fully_shard(root, reshard_after_forward=False, **options)
    for module in [m for root in (model, *roots) for m in root.modules()]:
        if isinstance(module, FSDPModule):
            # The loss is already a share of the global mean: sum, don't average. Plain SUM
            # also avoids PREMUL_SUM, which gloo lacks (FSDP would pick it for fp32/bf16).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def fsdp_wanted(parallel_dims: ParallelDims, *, offload_params: bool) -> bool:
    """Whether the trainer shards with :func:`apply_fsdp`: when more than one rank shares the loss (dp x cp), and
    over one rank when tensor parallelism is on or ``offload_params`` asks for FSDP2's CPUOffloadPolicy."""
    return parallel_dims.dp_cp_size > 1 or parallel_dims.tp_enabled or offload_params


def fsdp_applied(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by :func:`apply_fsdp` (then FSDP2 owns its mixed precision): it, or with
    pipeline stages as roots (``roots``), one of its modules is an FSDP unit."""
    return any(isinstance(m, FSDPModule) for m in model.modules())
