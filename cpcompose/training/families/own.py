"""cpcompose's own model families (`cpcompose.models`: llama), as the trainer sees them.

Built from the config's shape with random weights (the same on every rank: initialised whole, then cut
and parallelized), made context-parallel by a `ContextParallel` style on their attention modules; the
style is kept to switch packed layouts per batch, and applied at cp == 1 too, so documents stay masked.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter
from cpcompose.config import ConfigError, JobConfig, cp_options
from cpcompose.distributed import ParallelDims
from cpcompose.distributed.pipeline_stage import StageModule
from cpcompose.layouts import PackedLayout
from cpcompose.models import get_model_spec
from cpcompose.models.spec import MemoryProfile
from cpcompose.parallel import ContextParallel, verify
from cpcompose.training.errors import TrainingError
from cpcompose.training.families.record import TrainedModel
from cpcompose.training.mixed_precision import compute_dtype
from cpcompose.training.units import human_count

__all__ = ["OwnFamily"]

FOLDER_KEYS = ("path", "rope_scaling", "max_position_embeddings")
"""The `[model]` keys of a family read from a folder: an own family refuses them."""


@dataclass(frozen=True)
class OwnFamily:
    """The record of one `cpcompose.models` family."""

    name: str
    folder_families: tuple[str, ...] = ()
    """The families that do read a folder (named in the refusal of `model.path`)."""
    reads_folder: bool = False
    exports: bool = False
    rank_imports: tuple[str, ...] = ()

    def refusal(self, config: JobConfig) -> ConfigError | None:
        if config.parallelism.ep > 1:
            return ConfigError(f"parallelism.ep: {config.parallelism.ep}: {self.name} has no experts (no "
                               "mixture-of-experts layer); set parallelism.ep = 1")
        for key in FOLDER_KEYS:
            if getattr(config.model, key) is not None:
                where = " or ".join(f"'{n}'" for n in self.folder_families) or "a family read from a folder"
                return ConfigError(f"model.{key}: only applies to model.name = {where} (a Hugging Face model); "
                                   "remove it")
        return None

    def resolve(self, config: JobConfig) -> JobConfig:
        return config  # the config is the whole model: nothing to read

    def check(self, config: JobConfig) -> None:
        return None

    def describe(self, config: JobConfig) -> tuple[int, str]:
        m = config.model
        with torch.device("meta"):
            model = get_model_spec(m.name).build(m, max_seq_len=config.max_seq_len())
            n = sum(x.numel() for x in model.parameters())
        return n, (f"{m.name}, {human_count(n)} parameters ({m.n_layers} layers, dim {m.dim}, {m.n_heads} heads, "
                   f"{m.n_kv_heads} kv heads)")

    def memory_profile(self, config: JobConfig, *, tp: int, precision: str, mlp_tiles: int) -> MemoryProfile:
        spec = get_model_spec(self.name)
        if spec.memory is None:
            raise ValueError(f"model.name: the {self.name!r} family has no memory profile; the plan cannot predict it")
        if config.training.tiled_block > 1:  # the own Llama's tiled blocks (refused for any other family)
            return spec.memory(config.model, tp=tp, precision=precision, mlp_tiles=mlp_tiles,
                               block_tiles=config.training.tiled_block)
        return spec.memory(config.model, tp=tp, precision=precision, mlp_tiles=mlp_tiles)

    def build(self, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
              meter: CommMeter, stages: tuple[int, ...] = (0,), num_stages: int = 1) -> TrainedModel:
        spec = get_model_spec(self.name)
        model = spec.build(config.model, max_seq_len=config.max_seq_len())
        model.init_weights(seed=config.job.seed)
        bodies: tuple[nn.Module, ...] = ()
        if dims.pp_enabled:
            model, bodies = spec.split_for_pipeline(model, num_stages=num_stages, stage_ids=stages)
        model.to(device)
        if dims.cp_enabled and config.parallelism.cp_verify and not dims.pp_enabled:
            _verify(model, config, dims=dims, mesh=mesh, device=device)
        return self.parallelize(model, config, dims=dims, mesh=mesh, meter=meter, stage_bodies=bodies)

    def build_unfilled(self, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh,
                       stages: tuple[int, ...] = (0,), num_stages: int = 1) -> TrainedModel:
        spec = get_model_spec(self.name)
        model = spec.build(config.model, max_seq_len=config.max_seq_len())
        bodies: tuple[nn.Module, ...] = ()
        if dims.pp_enabled:
            model, bodies = spec.split_for_pipeline(model, num_stages=num_stages, stage_ids=stages)
        return self.parallelize(model, config, dims=dims, mesh=mesh, meter=None, stage_bodies=bodies)

    def parallelize(self, model: nn.Module, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh,
                    meter: CommMeter | None, stage_bodies: tuple[nn.Module, ...] = ()) -> TrainedModel:
        """As `ModelFamily.parallelize`; with pipelining, `stage_bodies` are the views of the rank's stages
        (`split_for_pipeline`), each wrapped in a `StageModule` whose CP scope is this style's (so a packed
        microbatch's `doc_bounds` set the layout of its forward, and its recompute's through the checkpoint's
        `ContextParallel.recompute_context`)."""
        c = config
        style = ContextParallel(cp_options(c.parallelism, meter=meter), seq_dim=1) \
            if dims.cp_enabled or c.data.pack else None

        def cp_scope(packed: PackedLayout | None) -> contextlib.AbstractContextManager:
            return style.layout_for(packed) if packed is not None and style is not None else contextlib.nullcontext()

        stages = tuple(StageModule(body, cp_scope, dims.cp) for body in stage_bodies)
        model = get_model_spec(self.name).parallelize(
            model, parallel_dims=dims, mesh=mesh, cp=style,
            activation_checkpoint=c.activation_checkpoint.mode == "full", torch_compile=c.training.compile,
            offload_activations=c.activation_checkpoint.offload, mlp_tiles=c.training.tiled_mlp,
            block_tiles=c.training.tiled_block,
            param_dtype=compute_dtype(c), offload_params=c.training.offload_params, stages=stages,
        )
        return TrainedModel(module=model, cp_scope=cp_scope, stages=stages)


def _verify(model: nn.Module, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, device: torch.device) -> None:
    """The exactness probe on the whole model before it is parallelized (see `parallelism.cp_verify`).

    A pipeline stage holds part of the model, so the probe runs only without pipelining.
    """
    p = config.parallelism
    length = 2 * dims.cp * 8
    tokens = torch.randint(0, config.model.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length)[None]
    try:
        verify(model, mesh["cp"], [tokens.to(device), positions.to(device)],
               options=cp_options(p).replace(layout=p.cp_layout, meter=None))
    except ValueError as e:  # raised on every rank alike: a configuration-like error, printed once
        raise TrainingError(f"parallelism.cp_verify: {e}", exit_code=2) from None
