"""What the trainer needs from a model family, as one :class:`ModelSpec` per family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.distributed import ParallelDims
from cpcompose.parallel.style import ContextParallel

__all__ = ["BuildFn", "ModelSpec", "ParallelizeFn", "SplitForPipelineFn"]


class BuildFn(Protocol):
    """Construct a family's model from a config's ``model`` section, for rows of up to ``max_seq_len`` tokens.

    The section is read by the fields the family declares (its own settings protocol),
    so a model family never imports the config.
    """

    def __call__(self, model: Any, *, max_seq_len: int) -> nn.Module: ...


class ParallelizeFn(Protocol):
    """A family's plan: apply CP, TP, MLP tiling, activation checkpointing (with offload), compile and FSDP2,
    in place."""

    def __call__(
        self,
        model: nn.Module,
        *,
        parallel_dims: ParallelDims,
        mesh: DeviceMesh,
        cp: ContextParallel | None,
        activation_checkpoint: bool,
        torch_compile: bool,
        offload_activations: bool,
        mlp_tiles: int,
    ) -> nn.Module: ...


class SplitForPipelineFn(Protocol):
    """Cut a full model down, in place, to the modules of pipeline stage ``stage_index``."""

    def __call__(self, model: nn.Module, *, num_stages: int, stage_index: int) -> nn.Module: ...


@dataclass(frozen=True)
class ModelSpec:
    """One model family: how to build it from the config, parallelize it, and cut it for pipelining."""

    name: str
    """The ``model.name`` that selects this family."""
    build: BuildFn
    """Construct the model from the config's ``model`` section (on the current default device, ``meta`` included).
    The module must have ``init_weights(*, seed: int)``, which gives identical weights on every
    rank and works on a cut pipeline stage, and its ``forward(tokens, position_ids, *, head=None)`` must call
    ``head(hidden, output_weight)`` in place of its output projection when given (the fused loss)."""
    parallelize: ParallelizeFn
    """The family's plan (see :class:`ParallelizeFn`)."""
    split_for_pipeline: SplitForPipelineFn
    """Keep only one pipeline stage's modules, with the full model's FQNs."""
