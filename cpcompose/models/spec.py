"""What the trainer needs from a model family, as one :class:`ModelSpec` per family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.distributed import ParallelDims
from cpcompose.parallel.style import ContextParallel

if TYPE_CHECKING:  # the config imports the registry, so only type-check against it
    from cpcompose.config import JobConfig

__all__ = ["ModelSpec", "ParallelizeFn", "SplitForPipelineFn"]


class ParallelizeFn(Protocol):
    """A family's plan: apply CP, TP, activation checkpointing, compile and FSDP2, in place."""

    def __call__(
        self,
        model: nn.Module,
        *,
        parallel_dims: ParallelDims,
        mesh: DeviceMesh,
        cp: ContextParallel | None,
        activation_checkpoint: bool,
        torch_compile: bool,
    ) -> nn.Module: ...


class SplitForPipelineFn(Protocol):
    """Cut a full model down, in place, to the modules of pipeline stage ``stage_index``."""

    def __call__(self, model: nn.Module, *, num_stages: int, stage_index: int) -> nn.Module: ...


@dataclass(frozen=True)
class ModelSpec:
    """One model family: how to build it from the config, parallelize it, and cut it for pipelining."""

    name: str
    """The ``model.name`` that selects this family."""
    build: Callable[[JobConfig], nn.Module]
    """Construct the model from the config (on the current default device, ``meta`` included).
    The module must have ``init_weights(*, seed: int)``, which gives identical weights on every
    rank and works on a cut pipeline stage."""
    parallelize: ParallelizeFn
    """The family's plan (see :class:`ParallelizeFn`)."""
    split_for_pipeline: SplitForPipelineFn
    """Keep only one pipeline stage's modules, with the full model's FQNs."""
