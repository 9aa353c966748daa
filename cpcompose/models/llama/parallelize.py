"""The Llama plan: which modules get CP, the TP plan, which modules are blocks for AC, compile and FSDP.

The model code (``model.py``) knows nothing of process groups; everything
parallel happens here, from outside, on a model (or one pipeline stage of it,
see :func:`split_llama_for_pipeline`) built with identical weights on every
rank. The mechanics that are the same for every model live in
``cpcompose.distributed``; this file only says where they apply. The order, as
in torchtitan, is:

1. **CP** (``cp > 1``): ``ContextParallel`` on every ``layers.*.attention``
   over ``mesh["cp"]``. The rest of the model runs on the local sequence
   shard as it is; the caller feeds each rank its shard of the tokens and their
   global positions (``cp_shard``, ``cp_position_ids``).
2. **TP** (``tp > 1``): column-wise ``wq``/``wk``/``wv``/``w1``/``w3``, row-wise
   ``wo``/``w2`` on ``mesh["tp"]`` (heads are split, no sequence parallelism).
   The attention sees plain local tensors (fewer heads), so CP composes with it.
3. **Tiled MLP** (``mlp_tiles > 1``): every ``feed_forward`` runs over sequence
   tiles with recompute (``apply_tiled_mlp``), so its ``seq x ffn_hidden_dim``
   intermediates are never whole. Not with compile (dynamo cannot trace the
   recompute inside its backward).
4. **Activation checkpointing** (optional): each ``TransformerBlock`` recomputes
   its forward in backward. The CP hooks fire again during the recompute, so the
   recompute communicates too. With ``offload_activations``, the inputs each block
   keeps wait in pinned host memory (CUDA only; nothing changes on the CPU).
5. **Compile** (optional): each block whole, with ``fullgraph=True``: CP attention
   is one opaque custom op in the graph (``cpcompose.attention.call.op``). With
   activation checkpointing, each block's parts instead, inside the checkpoint
   (dynamo may not enter the CP mode inside a traced checkpoint).
6. **FSDP2** (``dp_replicate * dp_shard * cp > 1``, or over one rank with tp or
   ``offload_params``: ``fsdp_wanted``; unless ``fsdp=False``): as
   torchtitan, ``tok_embeddings`` alone, one unit per ``TransformerBlock``, then
   ``norm`` and ``output`` together (kept gathered into the backward), over
   dp_shard x cp (HSDP with dp_replicate), which also sums the gradients over cp.
   With ``param_dtype`` (bfloat16 training) each unit is gathered in that dtype,
   while the sharded float32 parameters stay the optimizer's and gradients reduce
   in float32 (FSDP2's ``MixedPrecisionPolicy``); no autocast is needed.

With ``fsdp=False`` nothing reduces the gradients (and tp alone leaves plain tensors beside
DTensors): when ``parallel_dims.dp_cp_size
> 1``, call ``allreduce_gradients(model, flat_mesh(mesh, "dp_cp"))`` after
backward (after the whole pipeline step, with PP). TP needs no reduction: each TP
rank owns its shard and the replicated norms get identical gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from cpcompose.distributed import (
    ParallelDims,
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    apply_tiled_mlp,
    fsdp_wanted,
)
from cpcompose.models.llama.model import Llama
from cpcompose.parallel.parallelize import parallelize_module
from cpcompose.parallel.style import ContextParallel

__all__ = ["parallelize_llama"]

# Per block: split heads / FFN columns, then sum the row-wise halves back (no sequence parallelism).
_TP_PLAN: dict[str, type[ColwiseParallel] | type[RowwiseParallel]] = {
    "attention.wq": ColwiseParallel,
    "attention.wk": ColwiseParallel,
    "attention.wv": ColwiseParallel,
    "attention.wo": RowwiseParallel,
    "feed_forward.w1": ColwiseParallel,
    "feed_forward.w3": ColwiseParallel,
    "feed_forward.w2": RowwiseParallel,
}


def parallelize_llama(
    model: Llama,
    *,
    parallel_dims: ParallelDims,
    mesh: DeviceMesh,
    cp: ContextParallel | None = None,
    activation_checkpoint: bool = False,
    torch_compile: bool = False,
    fsdp: bool = True,
    offload_activations: bool = False,
    mlp_tiles: int = 1,
    block_tiles: int = 1,
    param_dtype: torch.dtype | None = None,
    offload_params: bool = False,
    stages: Sequence[nn.Module] = (),
) -> Llama:
    """Make ``model`` (a full model or one pipeline stage) parallel, in place.

    Args:
        model: a :class:`Llama`, weights already initialised identically on every rank.
        parallel_dims: the degrees; ``parallel_dims.pp`` is only read by the FSDP step.
        mesh: the root mesh from ``parallel_dims.build_mesh(...)``.
        cp: the ContextParallel style (holding the run's `CPOptions`) to apply to every
            attention over ``mesh["cp"]``; None means the default options when cp > 1 and
            no CP otherwise. The caller keeps it to switch packed layouts per batch; given
            with cp == 1, packed documents stay masked.
        activation_checkpoint: recompute each transformer block in backward.
        offload_activations: with ``activation_checkpoint``, keep each block's saved inputs in
            pinned host memory on CUDA (no change on the CPU).
        mlp_tiles: sequence tiles each feed-forward runs over (1: untiled).
        block_tiles: sequence tiles each block's token-wise parts run over (`TransformerBlock.tile`; 1: untiled);
            it covers the feed-forward, so ``mlp_tiles`` is then not applied.
        torch_compile: compile each block (its parts, with activation checkpointing).
        param_dtype: with FSDP, the dtype the units are gathered and computed in (None: float32).
        offload_params: sharded parameters, gradients and optimizer state in host memory (FSDP2's
            CPUOffloadPolicy; on one rank over dp x cp too, over a one-rank mesh).
        fsdp: shard parameters with FSDP2 over dp_shard x cp (HSDP when
            dp_replicate > 1) when more than one rank shares the loss. With
            ``False`` the caller reduces gradients (see the module docstring).
        stages: with pipelining, the modules the rank's ``PipelineStage``s run (views sharing
            ``model``'s modules: `split_llama_for_stages`, each wrapped in a ``StageModule``); with
            FSDP each is an FSDP root instead of ``model`` (a stage reduces its gradients through
            its root).

    Returns:
        ``model`` itself. Parameters are DTensors where TP or FSDP applies; FQNs
        are unchanged (activation checkpointing and compile wrap no module).

    Raises:
        ValueError: the mesh does not have the axes of ``ParallelDims.build_mesh``
            or their sizes differ from ``parallel_dims``; ``offload_activations`` without
            ``activation_checkpoint``; ``mlp_tiles`` < 1, or > 1 with ``torch_compile``.
    """
    parallel_dims.check_mesh(mesh)
    if offload_activations and not activation_checkpoint:
        raise ValueError("offload_activations moves what activation checkpointing saves: it needs "
                         "activation_checkpoint=True")
    if max(mlp_tiles, block_tiles) > 1 and torch_compile:
        raise ValueError("mlp_tiles or block_tiles > 1 does not compile (the tiles' backward recomputes under "
                         "autograd): use one or the other")
    if block_tiles > 1 and parallel_dims.tp_enabled:
        raise ValueError("block_tiles > 1 is not supported with tensor parallelism: use mlp_tiles")
    if cp is None and parallel_dims.cp_enabled:  # never leave cp > 1 without CP attention
        cp = ContextParallel(seq_dim=1)
    if cp is not None:
        parallelize_module(model, mesh["cp"], {"layers.*.attention": cp})
    blocks = list(model.layers.values())
    if parallel_dims.tp_enabled:
        for block in blocks:
            parallelize_module(block, mesh["tp"], {name: style() for name, style in _TP_PLAN.items()})
    for block in blocks:
        block.tile(block_tiles)
    if block_tiles == 1:
        apply_tiled_mlp([block.feed_forward for block in blocks], tiles=mlp_tiles)
    if activation_checkpoint:
        # The recompute re-enters the packed layout its forward ran under: a pipeline schedule runs a
        # microbatch's backward outside the scope of its forward.
        apply_activation_checkpointing(blocks, offload=offload_activations,
                                       context_fn=cp.recompute_context if cp is not None else None)
    if torch_compile:
        # Dynamo traces AC's checkpoint as a higher-order op, inside which the CP hooks may not
        # enter their TorchFunctionMode: with AC, compile each block's parts, inside the checkpoint.
        apply_compile(blocks if not activation_checkpoint else [m for b in blocks for m in b.children()])
    if fsdp and fsdp_wanted(parallel_dims, offload_params=offload_params):
        # tp or offload_params without dp x cp: FSDP2 over one rank, so that every parameter is a DTensor (the
        # fused AdamW takes no mix of DTensors and plain tensors), or its CPUOffloadPolicy keeps them on the host
        apply_fsdp(model, blocks, mesh=mesh, parallel_dims=parallel_dims, embedding=model.tok_embeddings,
                   head=[m for m in (model.norm, model.output) if m is not None], param_dtype=param_dtype,
                   offload_params=offload_params, roots=stages)
    return model
