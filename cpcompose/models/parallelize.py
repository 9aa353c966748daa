"""Apply CP, TP, activation checkpointing and FSDP2 to a :class:`Llama`, in one fixed order.

The model code (``llama.py``) knows nothing of process groups; everything
parallel happens here, from outside, on a model (or one pipeline stage of it,
see :func:`cpcompose.models.split_llama_for_pipeline`) built with identical
weights on every rank. The order, as in torchtitan, is:

1. **CP** (``cp > 1``): ``ContextParallel`` on every ``layers.*.attention``
   over ``mesh["cp"]``. The rest of the model runs on the local sequence
   shard as it is; the caller feeds each rank its shard of the tokens and their
   global positions (``cp_shard``, ``cp_position_ids``).
2. **TP** (``tp > 1``): column-wise ``wq``/``wk``/``wv``/``w1``/``w3``, row-wise
   ``wo``/``w2`` on ``mesh["tp"]`` (heads are split, no sequence parallelism).
   The attention sees plain local tensors (fewer heads), so CP composes with it.
3. **Activation checkpointing** (optional): each ``TransformerBlock`` recomputes
   its forward in backward (non-reentrant ``torch.utils.checkpoint``). The CP
   hooks fire again during the recompute, so the recompute communicates too.
4. **FSDP2** (``dp_replicate * dp_shard * cp > 1``, unless ``fsdp=False``):
   ``fully_shard`` on each block and on the root, over ``dp_shard_cp`` (or HSDP
   over ``("dp_replicate", "dp_shard_cp")``). CP ranks hold the same parameters
   but see different tokens, so FSDP over dp_shard x cp also reduces the
   gradients over cp.

Gradients are summed, never averaged: ``cp_cross_entropy`` already divides by
the global token count, so each rank's loss is its share of the global mean and
the shares' gradients add up to the single-device gradient. FSDP is therefore
set to divide by 1 and to use plain SUM reductions.

Without FSDP (``fsdp=False``, e.g. TP x CP or PP x CP kept replicated) nothing
reduces the gradients: after backward call
``allreduce_gradients(model, flat_mesh(mesh, "dp_cp"))`` whenever
:func:`needs_manual_grad_reduce` says so.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from cpcompose.comm import CommMeter
from cpcompose.models.llama import Llama, TransformerBlock
from cpcompose.parallel.parallel_dims import ParallelDims, flat_mesh
from cpcompose.parallel.style import ContextParallel

__all__ = ["build_pipeline_stage", "needs_manual_grad_reduce", "parallelize_llama"]

_TP_PLAN = {
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}


def parallelize_llama(
    model: Llama,
    *,
    parallel_dims: ParallelDims,
    mesh: DeviceMesh,
    cp_strategy: str = "ring",
    cp_layout: str = "zigzag",
    activation_checkpoint: bool = False,
    fsdp: bool = True,
    meter: CommMeter | None = None,
    cp_style: ContextParallel | None = None,
) -> Llama:
    """Make ``model`` (a full model or one pipeline stage) parallel, in place.

    Args:
        model: a :class:`Llama`, weights already initialised identically on every rank.
        parallel_dims: the degrees; ``parallel_dims.pp`` is only read by the FSDP step.
        mesh: the root mesh from ``parallel_dims.build_mesh(...)``.
        cp_strategy: "ring", "allgather" or "alltoall".
        cp_layout: how the caller sharded the sequence: "zigzag" or "contiguous".
        activation_checkpoint: recompute each transformer block in backward.
        fsdp: shard parameters with FSDP2 over dp_shard x cp (HSDP when
            dp_replicate > 1) when that group has more than one rank. With
            ``False`` the caller reduces gradients (see :func:`needs_manual_grad_reduce`).
        meter: counts the bytes CP attention sends.
        cp_style: the ContextParallel style to apply (the caller keeps it to switch
            packed layouts per batch); given, it is applied even when cp == 1, so
            packed documents stay masked on a single rank too.

    Returns:
        ``model`` itself. Parameters are DTensors where TP or FSDP applies; FQNs
        are unchanged (activation checkpointing wraps no module).

    Raises:
        ValueError: the mesh does not have the axes of ``ParallelDims.build_mesh``
            or their sizes differ from ``parallel_dims``.
        TypeError: activation checkpointing on layers that are not ``TransformerBlock``.
    """
    _check_mesh(mesh, parallel_dims)
    if cp_style is not None or parallel_dims.cp_enabled:
        style = cp_style or ContextParallel(strategy=cp_strategy, layout=cp_layout, seq_dim=1, meter=meter)
        parallelize_module(model, mesh["cp"], {"layers.*.attention": style})
    if parallel_dims.tp_enabled:
        _apply_tp(model, mesh["tp"])
    if activation_checkpoint:
        for block in model.layers.values():
            _checkpoint_block(block)
    if fsdp and parallel_dims.dp_cp_size > 1:
        _apply_fsdp(model, mesh, parallel_dims)
    return model


def needs_manual_grad_reduce(parallel_dims: ParallelDims, *, fsdp: bool = True) -> bool:
    """Whether the caller must sum gradients over ``dp_cp`` after backward.

    True exactly when more than one rank shares the loss (``dp_replicate *
    dp_shard * cp > 1``) and :func:`parallelize_llama` was told ``fsdp=False``;
    then call ``allreduce_gradients(model, flat_mesh(mesh, "dp_cp"))`` (after the
    whole pipeline step, with PP). TP needs no reduction: each TP rank owns its
    shard and the replicated norms get identical gradients on every TP rank.

    Args:
        parallel_dims: the degrees given to :func:`parallelize_llama`.
        fsdp: the ``fsdp`` argument given to :func:`parallelize_llama`.
    """
    return parallel_dims.dp_cp_size > 1 and not fsdp


def build_pipeline_stage(
    stage_model: nn.Module, *, parallel_dims: ParallelDims, mesh: DeviceMesh, device: torch.device | str = "cpu"
) -> PipelineStage:
    """Wrap this rank's stage (cut and parallelised) as a ``PipelineStage`` on the ``pp`` group.

    Build the stage with ``split_llama_for_pipeline(model, num_stages=pp,
    stage_index=mesh["pp"].get_local_rank())`` and then :func:`parallelize_llama`.
    Pass ``position_ids`` to the schedule's ``step`` as a ``[batch, seq]`` keyword
    on every stage (they are split into microbatches like the tokens), and use
    ``scale_grads=False`` with a ``cp_cross_entropy`` loss whose ``num_tokens`` is
    the global count over the whole batch, so the microbatch losses sum to the
    rank's share.

    Raises:
        ValueError: pipelining is not enabled in ``parallel_dims``.
    """
    if not parallel_dims.pp_enabled:
        raise ValueError("build_pipeline_stage needs parallelism.pp > 1")
    pp_mesh = mesh["pp"]
    return PipelineStage(
        stage_model,
        stage_index=pp_mesh.get_local_rank(),
        num_stages=parallel_dims.pp,
        device=torch.device(device),
        group=pp_mesh.get_group(),
    )


def _check_mesh(mesh: DeviceMesh, parallel_dims: ParallelDims) -> None:
    names = mesh.mesh_dim_names or ()
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        if name not in names:
            raise ValueError(f"mesh has axes {names}; pass the root mesh from ParallelDims.build_mesh")
        if mesh[name].size() != getattr(parallel_dims, name):
            raise ValueError(
                f"mesh axis {name!r} has {mesh[name].size()} ranks but parallel_dims.{name} is "
                f"{getattr(parallel_dims, name)}; build the mesh from the same ParallelDims"
            )


def _apply_tp(model: Llama, tp_mesh: DeviceMesh) -> None:
    for block in model.layers.values():
        plan = {name: ColwiseParallel() if kind == "colwise" else RowwiseParallel() for name, kind in _TP_PLAN.items()}
        parallelize_module(block, tp_mesh, plan)


class _CheckpointedForward:
    """Mixin: run the class's forward under non-reentrant activation checkpointing."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)  # type: ignore[misc]


_CHECKPOINTED_CLASSES: dict[type, type] = {}


def _checkpoint_block(block: nn.Module) -> None:
    # Swap the class (as fully_shard does) instead of wrapping the module, so FQNs,
    # state dicts and `isinstance(block, TransformerBlock)` stay as they are.
    cls = type(block)
    if issubclass(cls, _CheckpointedForward):
        return
    if not isinstance(block, TransformerBlock):
        raise TypeError(f"activation checkpointing expects TransformerBlock layers, got {cls.__name__}")
    new_cls = _CHECKPOINTED_CLASSES.get(cls)
    if new_cls is None:
        new_cls = _CHECKPOINTED_CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (_CheckpointedForward, cls), {})
    block.__class__ = new_cls


def _apply_fsdp(model: Llama, mesh: DeviceMesh, parallel_dims: ParallelDims) -> None:
    dp_mesh = flat_mesh(mesh, "dp_shard_cp")
    if parallel_dims.dp_replicate_enabled:
        # HSDP: replicate outer, shard inner. torch 2.13 warns that slicing a flattened dim
        # "will be deprecated" but has no public alternative; the slice creates no new groups.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
            dp_mesh = mesh["dp_replicate", "dp_shard_cp"]
    # With PP, each block runs once per microbatch: keep it unsharded between them.
    reshard = not parallel_dims.pp_enabled
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already a share of the global mean: sum, don't average. Plain SUM
            # also avoids PREMUL_SUM, which gloo lacks (FSDP would pick it for fp32/bf16).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
