"""A rank's pipeline stage on the ``pp`` group, and the schedule that runs it.

The model family cuts the model (module surgery, no process groups); this module
turns the cut stage into a ``torch.distributed.pipelining`` stage and schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from cpcompose.distributed.parallel_dims import ParallelDims

__all__ = ["build_pipeline_schedule", "build_pipeline_stage"]

_SCHEDULES: dict[str, type[ScheduleGPipe | Schedule1F1B]] = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


def build_pipeline_stage(
    stage_model: nn.Module, *, parallel_dims: ParallelDims, mesh: DeviceMesh, device: torch.device | str = "cpu"
) -> PipelineStage:
    """Wrap this rank's stage (cut and parallelised) as a ``PipelineStage`` on the ``pp`` group.

    Cut the stage with the family's split (e.g. ``split_llama_for_pipeline(model,
    num_stages=pp, stage_index=mesh["pp"].get_local_rank())``), parallelise it, then
    call this. Pass ``position_ids`` to the schedule's ``step`` as a ``[batch, seq]``
    keyword on every stage (they are split into microbatches like the tokens).

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


def build_pipeline_schedule(
    stage: PipelineStage,
    *,
    schedule: Literal["GPipe", "1F1B"],
    microbatches: int,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> ScheduleGPipe | Schedule1F1B:
    """The schedule that runs ``stage`` with ``microbatches`` microbatches per step.

    ``loss_fn`` must return the microbatch's share of the global mean (e.g.
    ``cp_cross_entropy`` with ``num_tokens`` counted over the whole global batch),
    so the microbatch losses sum to the rank's share: the schedule is told not to
    divide gradients by the number of microbatches again.

    Raises:
        ValueError: an unknown schedule name.
    """
    if schedule not in _SCHEDULES:
        raise ValueError(f"parallelism.pp_schedule: {schedule!r} is not one of {', '.join(_SCHEDULES)}")
    return _SCHEDULES[schedule](stage, microbatches, loss_fn=loss_fn, scale_grads=False)
