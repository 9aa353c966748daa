"""A rank's pipeline stages on the ``pp`` group, and the schedule that runs them.

The model family cuts the model (module surgery, no process groups); this module
says which stages a rank owns under each of torch's schedules, checks what a schedule
needs before launch, and turns the cut stages into ``torch.distributed.pipelining``
stages and a schedule.

Schedules (torch 2.13, ``torch.distributed.pipelining.schedules``):

* ``GPipe``, ``1F1B``: ``PipelineScheduleSingle``, one stage per rank (1F1B needs at
  least ``pp`` microbatches).
* ``Interleaved1F1B``, ``InterleavedZeroBubble``, ``LoopedBFS``: ``PipelineScheduleMulti``
  with loop placement, rank ``r`` owns stages ``r, r + pp, r + 2 pp, ...``. The two
  interleaved ones need the microbatches to be a multiple of their rounds,
  ``max(1, microbatches // pp)``.
* ``ZBVZeroBubble``, ``DualPipeV``: exactly two stages per rank in a V, rank ``r`` owns
  ``r`` and ``2 pp - 1 - r`` (so rank 0 holds both the first and the last stage).

Every multi-stage schedule here is asked for at least as many microbatches as stages:
DualPipeV refuses fewer itself, ZBV plans ``max(2 pp - 1, microbatches)`` microbatches
(actions for microbatches that never come), and the interleaved schedules idle their
later stages; the check is made before launch (`pipeline_problem`), not by a hang.

The zero-bubble schedules split each backward into an input part (sent upstream at once)
and a weight part (run later to fill the bubble). Activation checkpointing composes with
this (the non-reentrant recompute happens in the input part and its saved tensors serve
the weight part), and FSDP2 too: each stage module is its own FSDP root, the stage keeps
gradient sync off until its last backward and reduces once (``perform_reduce_grad``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from cpcompose.distributed.parallel_dims import ParallelDims

__all__ = [
    "LOOP_SCHEDULES", "PIPELINE_SCHEDULES", "SINGLE_STAGE_SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "V_SCHEDULES", "build_pipeline_schedule",
    "build_pipeline_stage", "build_pipeline_stages", "pipeline_problem", "stage_ids", "stages_per_rank",
]

PIPELINE_SCHEDULES: dict[str, type[PipelineScheduleSingle] | type[PipelineScheduleMulti]] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
    "LoopedBFS": ScheduleLoopedBFS,
}
"""`parallelism.pp_schedule`'s names, torch's own, and their classes."""
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
"""One stage per rank."""
LOOP_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS")
"""Several stages per rank, rank r owning r, r + pp, r + 2 pp, ..."""
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Two stages per rank in a V: rank r owns r and 2 pp - 1 - r."""
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""The schedules that split each backward into an input and a weight part, which torch 2.13 does not run through
torch.compile (it refuses compiled stage modules; blocks compiled in place hung the ranks here)."""
_ROUNDS = ("Interleaved1F1B", "InterleavedZeroBubble")
"""The schedules that run their microbatches in rounds of max(1, microbatches // pp)."""


def stages_per_rank(config_parallelism: Any, n_layers: int) -> int:
    """The stages each rank runs: ``n_layers / pp_layers_per_stage / pp``, or unset, 1 for the single-stage
    schedules and 2 for the others (a V has two).

    ``config_parallelism`` is the config's ``parallelism`` section (read for ``pp``, ``pp_schedule`` and
    ``pp_layers_per_stage``). Call `pipeline_problem` first: this assumes the numbers divide.
    """
    p = config_parallelism
    if p.pp_layers_per_stage is None:
        return 1 if p.pp_schedule in SINGLE_STAGE_SCHEDULES else 2
    return n_layers // p.pp_layers_per_stage // p.pp


def stage_ids(schedule: str, pp: int, pp_rank: int, stages_per_rank: int) -> tuple[int, ...]:
    """The global stage indices pipeline rank ``pp_rank`` owns under ``schedule``, in the order it runs them.

    Raises:
        ValueError: an unknown schedule, a rank out of range, or a stage count the schedule cannot place.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"parallelism.pp_schedule: {schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank must be in [0, {pp}), got {pp_rank}")
    if schedule in SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        raise ValueError(f"parallelism.pp_schedule: {schedule} runs one stage per rank, not {stages_per_rank}")
    if schedule in V_SCHEDULES:
        if stages_per_rank != 2:
            raise ValueError(f"parallelism.pp_schedule: {schedule} runs two stages per rank (a V), "
                             f"not {stages_per_rank}")
        return (pp_rank, 2 * pp - 1 - pp_rank)
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
    return tuple(pp_rank + i * pp for i in range(stages_per_rank))


def pipeline_problem(config_parallelism: Any, n_layers: int, local_batch: int | None = None, *,
                     compiled: bool = False) -> tuple[str, str] | None:
    """What of the pipeline settings the schedule cannot run, as ``(key, message)``; None when it can.

    Checked before launch (`JobConfig.validate`): the layers must cut evenly into ``pp`` x stages-per-rank
    stages, the schedule must be able to place that many stages per rank, and the microbatches must be as
    many as torch's schedule needs (see the module docstring) and divide ``local_batch`` (the sequences each
    pipeline step gets; None: not known yet); a split-backward schedule does not take compiled blocks
    (``compiled``: ``training.compile``).
    """
    p = config_parallelism
    pp, lps, name, micro = p.pp, p.pp_layers_per_stage, p.pp_schedule, p.pp_microbatches
    if pp == 1:
        return None
    if compiled and name in SPLIT_BACKWARD_SCHEDULES:
        return ("training.compile", f"{name} splits each backward into its input and weight parts, which torch does "
                "not run through torch.compile; set training.compile = false, or use Interleaved1F1B or 1F1B")
    if lps is not None:
        if n_layers % lps != 0:
            return ("parallelism.pp_layers_per_stage",
                    f"{lps} does not divide model.n_layers = {n_layers} into whole stages")
        total = n_layers // lps
        if total % pp != 0:
            return ("parallelism.pp_layers_per_stage",
                    f"{lps} layers a stage make {total} stages, not a multiple of parallelism.pp = {pp}")
        per_rank = total // pp
        if name in SINGLE_STAGE_SCHEDULES and per_rank != 1:
            return ("parallelism.pp_layers_per_stage",
                    f"{lps} layers a stage make {per_rank} stages per rank, but {name} runs one; use "
                    f"{n_layers // pp} (or unset it), or a multi-stage parallelism.pp_schedule such as Interleaved1F1B")
        if name in V_SCHEDULES and per_rank != 2:
            return ("parallelism.pp_layers_per_stage",
                    f"{lps} layers a stage make {per_rank} stages per rank, but {name} places exactly two (a V); "
                    f"use {n_layers // (2 * pp)} (or unset it)")
    else:
        per_rank = 1 if name in SINGLE_STAGE_SCHEDULES else 2
        total = per_rank * pp
        if n_layers % total != 0 and per_rank == 1:
            return ("model.n_layers", f"{n_layers} must be divisible by parallelism.pp = {pp}")
        if n_layers % total != 0:
            return ("model.n_layers", f"{n_layers} must be divisible by parallelism.pp x stages per rank = {total} "
                    f"({name} runs two stages per rank; set parallelism.pp_layers_per_stage to choose another "
                    "count)")
    if name == "1F1B" and micro < pp:
        return ("parallelism.pp_microbatches", f"1F1B needs >= pp = {pp}, got {micro}")
    if name not in SINGLE_STAGE_SCHEDULES and micro < total:
        return ("parallelism.pp_microbatches",
                f"{name} needs at least as many microbatches as stages ({total} = pp {pp} x {per_rank} per rank), "
                f"got {micro}")
    rounds = max(1, micro // pp)
    if name in _ROUNDS and micro % rounds != 0:
        return ("parallelism.pp_microbatches",
                f"{name} runs microbatches in rounds of microbatches // pp = {rounds}, which {micro} is not a "
                f"multiple of; use a multiple of pp = {pp}")
    if local_batch is not None and local_batch % micro != 0:
        return ("parallelism.pp_microbatches", f"{micro} must divide the local batch of {local_batch} sequences")
    return None


def build_pipeline_stage(
    stage_model: nn.Module, *, parallel_dims: ParallelDims, mesh: DeviceMesh, device: torch.device | str = "cpu",
    stage_index: int | None = None, num_stages: int | None = None,
) -> PipelineStage:
    """Wrap one stage module (cut and parallelised) as a ``PipelineStage`` on the ``pp`` group.

    Without ``stage_index`` / ``num_stages``: one stage per rank, this rank's pp index of ``pp`` stages
    (cut with e.g. ``split_llama_for_pipeline(model, num_stages=pp, stage_index=mesh["pp"].get_local_rank())``).
    Pass ``position_ids`` to the schedule's ``step`` as a ``[batch, seq]`` keyword on every stage (they are
    split into microbatches like the tokens).

    Raises:
        ValueError: pipelining is not enabled in ``parallel_dims``.
    """
    if not parallel_dims.pp_enabled:
        raise ValueError("build_pipeline_stage needs parallelism.pp > 1")
    pp_mesh = mesh["pp"]
    return PipelineStage(
        stage_model,
        stage_index=pp_mesh.get_local_rank() if stage_index is None else stage_index,
        num_stages=parallel_dims.pp if num_stages is None else num_stages,
        device=torch.device(device),
        group=pp_mesh.get_group(),
    )


def build_pipeline_stages(
    stage_modules: Sequence[nn.Module], stage_indices: Sequence[int], *, num_stages: int,
    parallel_dims: ParallelDims, mesh: DeviceMesh, device: torch.device | str = "cpu",
) -> list[PipelineStage]:
    """One ``PipelineStage`` per stage module this rank owns (``stage_indices`` from `stage_ids`), in order."""
    if len(stage_modules) != len(stage_indices):
        raise ValueError(f"{len(stage_modules)} stage modules for stages {tuple(stage_indices)}")
    return [build_pipeline_stage(m, parallel_dims=parallel_dims, mesh=mesh, device=device, stage_index=s,
                                 num_stages=num_stages) for m, s in zip(stage_modules, stage_indices)]


def build_pipeline_schedule(
    stages: PipelineStage | Sequence[PipelineStage],
    *,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The schedule that runs this rank's ``stages`` with ``microbatches`` microbatches per step.

    ``loss_fn`` must return the microbatch's share of the global mean (e.g.
    ``cp_cross_entropy`` with ``num_tokens`` counted over the whole global batch),
    so the microbatch losses sum to the rank's share: the schedule is told not to
    divide gradients by the number of microbatches again (``scale_grads=False``).

    Raises:
        ValueError: an unknown schedule name, or several stages for a single-stage schedule.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"parallelism.pp_schedule: {schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
    stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
    cls = PIPELINE_SCHEDULES[schedule]
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"parallelism.pp_schedule: {schedule} runs one stage per rank, got {len(stages)}")
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
