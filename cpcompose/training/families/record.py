"""What the trainer asks a model family: the record each family registers.

torchtitan's `TrainSpec` in the trainer's terms: one object per family (cpcompose's own Llama,
`own.py`; a Hugging Face causal LM, `hf/record.py`) answers everything family-specific, so the
trainer, the pre-launch checks, the memory plan, the dry run and the rehearsal never ask which
family they hold. `registry.py` finds the record of `model.name`.

What each family takes of the trainer's parallelisms is its own answer (`refusal`): tensor, pipeline
and expert parallelism and `torch.compile` arrive family by family, each lifting its refusal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter
from cpcompose.config import ConfigError, JobConfig
from cpcompose.distributed import ExpertShards, ParallelDims
from cpcompose.layouts import PackedLayout
from cpcompose.models.spec import MemoryProfile

__all__ = ["ModelFamily", "RouterLoss", "TrainedModel"]


@dataclass(frozen=True)
class RouterLoss:
    """A mixture-of-experts model's router load-balancing loss (transformers' `load_balancing_loss_func`, the
    Switch-Transformer loss), trained beside the language-model loss: the trainer adds `coefficient` x the loss
    over the whole micro-batch of the dp x cp mesh (`cpcompose.parallel.cp_load_balancing_loss`)."""

    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts chosen per token."""
    coefficient: float
    """The loss's weight in the trained total (transformers' `router_aux_loss_coef`)."""


@dataclass
class TrainedModel:
    """What the trainer trains: the parallelized module, the CP scope of a micro-batch, and an export."""

    module: nn.Module
    """Called as `module(tokens, position_ids)` -> logits, or `module(tokens, position_ids, head=head)` -> the
    result of `head(hidden, output_weight, bias=None, softcap=None)` (the fused loss); with `router_logits=True`
    (families with a `router_loss`) -> (that, every MoE layer's router logits `(local tokens, experts)`)."""
    cp_scope: Callable[[PackedLayout | None], contextlib.AbstractContextManager]
    """Around each micro-batch's forward and backward, given the batch's pack (None: the run's layout)."""
    stages: tuple[nn.Module, ...] = ()
    """With pipelining (empty without): this rank's stage modules, in the order of `build`'s `stages`, each what a
    `PipelineStage` runs and, with FSDP, an FSDP root of its own; called `stage(x, position_ids, **microbatch_meta)`
    (x: token ids on stage 0, hidden states otherwise; the last stage returns logits `[mb, local_seq, vocab]`;
    `cpcompose.distributed.pipeline_stage.StageModule` says how the per-microbatch `doc_bounds` of packed
    documents become the CP scope of its forward and of its recomputation). They share `module`'s submodules:
    `module` holds all of this rank's parameters under the FULL model's FQNs (the optimizer, clipping and DCP
    checkpoints use it, so a checkpoint reshards between pipeline layouts)."""
    export: Callable[[Path], None] | None = None
    """Write the model in its family's own format to a folder (a collective), for families that export
    (`checkpoint.export_hf`)."""
    expert_parameters: tuple[nn.Parameter, ...] = ()
    """With expert parallelism: the parameters each rank of `ep_group` holds a different block of experts of (the
    gradient norm sums their squares over that group)."""
    ep_group: dist.ProcessGroup | None = None
    """The expert-parallel group of `expert_parameters` (None without expert parallelism)."""
    expert_shards: ExpertShards | None = None
    """With expert parallelism: how the state's expert blocks are seen whole, so that checkpoints and the export
    write every expert once (and a checkpoint loads at another ep)."""
    router_loss: RouterLoss | None = None
    """The MoE router's load-balancing loss the model trains beside the language-model loss (None: none)."""


class ModelFamily(Protocol):
    """One model family, as the trainer sees it. Every method takes the run's config; none branches on another
    family."""

    name: str
    """Its `model.name`."""
    reads_folder: bool
    """Whether it loads the model from `model.path` (a folder whose tokenizer is then the data's default, and whose
    config.json gives the vocabulary); the others refuse `model.path` and its overrides."""
    exports: bool
    """Whether `checkpoint.export_hf` applies: the built model's `TrainedModel.export` is set."""
    rank_imports: tuple[str, ...]
    """The modules a rank of this family imports beyond the trainer's (their size is part of the rank's own)."""

    def refusal(self, config: JobConfig) -> ConfigError | None:
        """What of the config this family does not take (a parallelism, compile, an override), without I/O;
        None when it takes it all."""

    def resolve(self, config: JobConfig) -> JobConfig:
        """The config with what the family's files say filled in (the vocabulary of a model folder).

        Raises:
            ConfigError: the files do not read, or contradict a key the user set.
        """

    def check(self, config: JobConfig) -> None:
        """The pre-launch checks that read the family's files (a folder's config and weight headers)."""

    def describe(self, config: JobConfig) -> tuple[int, str]:
        """(parameters, a one-line description), from the model built on the meta device."""

    def memory_profile(self, config: JobConfig, *, tp: int, precision: str, mlp_tiles: int) -> MemoryProfile:
        """What the model holds per token and per parameter, for the memory plan.

        Raises:
            ValueError: the family has no profile, so the plan cannot predict it.
        """

    def parallelize(self, model: nn.Module, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh,
                    meter: CommMeter | None) -> TrainedModel:
        """The built model made parallel in the trainer's order, in place: CP (how it reaches the family's
        attention: a style on its modules or a region around each micro-batch), tiled MLPs, activation
        checkpointing, FSDP2 units; where tensor, pipeline and expert parallelism are applied as the family
        takes them."""

    def build(self, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
              meter: CommMeter, stages: tuple[int, ...] = (0,), num_stages: int = 1) -> TrainedModel:
        """Build, initialise or load, and parallelize the model on this rank (a collective).

        Args:
            stages: this rank's pipeline stages (`cpcompose.distributed.pipeline.stage_ids`), in the order it runs
                them; each gets a module in `TrainedModel.stages` when `num_stages` > 1.
            num_stages: the stages the layers are cut into: contiguously and evenly, stage s holding layers
                [s * n, (s + 1) * n); stage 0 the embedding; the last stage the final norm and the output head.
        Raises:
            TrainingError: (exit code 2) a configuration the model cannot take, or a module the exactness probe
                (`parallelism.cp_verify`) finds different under CP; the same on every rank.
        """

    def build_unfilled(self, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh,
                       stages: tuple[int, ...] = (0,), num_stages: int = 1) -> TrainedModel:
        """The model parallelized as `build` makes it, its weights never set: for the rehearsal under
        FakeTensorMode (`cpcompose.training.memory.rehearsal`), where values do not exist."""
