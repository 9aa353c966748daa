"""Trainer infrastructure that no model family owns: degrees and mesh, FSDP2, activation
checkpointing (with offload), sequence-tiled MLPs, pipeline stages and schedules, compile.

Each function takes the modules to act on from the caller (a model family's plan in
``cpcompose.models.<family>.parallelize``), so none of them knows a model's layout.
Context parallelism itself is the public API in ``cpcompose.parallel``.
"""

from cpcompose.distributed.activation_checkpoint import apply_activation_checkpointing
from cpcompose.distributed.compile import apply_compile
from cpcompose.distributed.expert_state import ExpertShards
from cpcompose.distributed.fsdp import apply_fsdp, fsdp_applied, fsdp_wanted
from cpcompose.distributed.parallel_dims import MESH_DIM_NAMES, ParallelDims, flat_mesh
from cpcompose.distributed.pipeline import (
    PIPELINE_SCHEDULES,
    build_pipeline_schedule,
    build_pipeline_stage,
    build_pipeline_stages,
    pipeline_problem,
    stage_ids,
    stages_per_rank,
)
from cpcompose.distributed.pipeline_stage import StageModule, layout_of_doc_bounds, microbatch_doc_bounds
from cpcompose.distributed.tiled import apply_tiled_mlp, tiled, tiled_mlp

__all__ = [
    "ExpertShards",
    "MESH_DIM_NAMES",
    "PIPELINE_SCHEDULES",
    "StageModule",
    "ParallelDims",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fsdp",
    "flat_mesh",
    "fsdp_applied",
    "fsdp_wanted",
    "apply_tiled_mlp",
    "build_pipeline_schedule",
    "build_pipeline_stage",
    "build_pipeline_stages",
    "layout_of_doc_bounds",
    "microbatch_doc_bounds",
    "pipeline_problem",
    "stage_ids",
    "stages_per_rank",
    "tiled",
    "tiled_mlp",
]
