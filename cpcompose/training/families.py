"""Which model a run trains: the one place that reads `model.name`.

Two kinds of family, behind one interface for the trainer, the pre-launch checks and the dry run:
- cpcompose's own (`cpcompose.models` registry: llama), built from the config's shape with random
  weights, made context-parallel by a `ContextParallel` style on its attention modules;
- a Hugging Face causal LM from a local folder (`model.name = "hf"`, `hf_model.py`), loaded from its
  weights, made context-parallel by a `context_parallel` region around each micro-batch.
`cpcompose.models` and `cpcompose.integrations` are sibling layers that may not import each other,
so the dispatch lives here, in the trainer's layer, which may import both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter
from cpcompose.config import HF_MODEL, ConfigError, JobConfig
from cpcompose.distributed import ParallelDims
from cpcompose.layouts import PackedLayout
from cpcompose.models import get_model_spec, model_names
from cpcompose.models.spec import MemoryProfile
from cpcompose.parallel import ContextParallel, verify
from cpcompose.training.errors import TrainingError
from cpcompose.training.units import human_count
from cpcompose.training.mixed_precision import compute_dtype

__all__ = [
    "TrainedModel", "build_trained_model", "build_unfilled_model", "check_model", "describe_model", "family_names",
    "memory_profile", "rank_imports",
]


def family_names() -> tuple[str, ...]:
    """Every `model.name` the trainer takes."""
    return (*model_names(), HF_MODEL)


def rank_imports(config: JobConfig) -> tuple[str, ...]:
    """The modules a rank of this family imports beyond the trainer's (their size is part of the rank's own)."""
    return ("cpcompose.integrations.transformers",) if config.model.name == HF_MODEL else ()


def check_model(config: JobConfig) -> None:
    """The model's pre-launch checks (a Hugging Face folder is read: its config and weight headers).

    Raises:
        ConfigError: naming the key to change.
    """
    if config.model.name == HF_MODEL:
        from cpcompose.training.hf_model import check_hf_model

        check_hf_model(config)


def describe_model(config: JobConfig) -> tuple[int, str]:
    """(parameters, a one-line description) of the configured model, built on the meta device.

    Raises:
        ConfigError: a Hugging Face folder that does not pass `check_model`.
    """
    m = config.model
    if m.name == HF_MODEL:
        from cpcompose.training.hf_model import describe_hf_model

        return describe_hf_model(config)
    with torch.device("meta"):
        model = get_model_spec(m.name).build(m, max_seq_len=config.max_seq_len())
        n = sum(x.numel() for x in model.parameters())
    return n, (f"{m.name}, {human_count(n)} parameters ({m.n_layers} layers, dim {m.dim}, {m.n_heads} heads, "
               f"{m.n_kv_heads} kv heads)")


def memory_profile(config: JobConfig, *, tp: int, precision: str, mlp_tiles: int) -> MemoryProfile:
    """What the configured model holds per token and per parameter, for the memory plan.

    Raises:
        ValueError: the family has no profile (`hf_memory.profiled_families` for Hugging Face models), so the
            plan cannot predict it.
    """
    m = config.model
    if m.name == HF_MODEL:
        from cpcompose.training.hf_memory import hf_memory_profile
        from cpcompose.training.hf_model import read_hf_config

        return hf_memory_profile(read_hf_config(config), tp=tp, precision=precision, mlp_tiles=mlp_tiles)
    spec = get_model_spec(m.name)
    if spec.memory is None:
        raise ValueError(f"model.name: the {m.name!r} family has no memory profile; the plan cannot predict it")
    return spec.memory(m, tp=tp, precision=precision, mlp_tiles=mlp_tiles)


@dataclass
class TrainedModel:
    """What the trainer trains: the parallelized module, the CP scope of a micro-batch, and an export."""

    module: nn.Module
    """Called as `module(tokens, position_ids)` -> logits, or `module(tokens, position_ids, head=head)` -> the
    result of `head(hidden, output_weight, bias=None, softcap=None)` (the fused loss)."""
    cp_scope: Callable[[PackedLayout | None], contextlib.AbstractContextManager]
    """Around each micro-batch's forward and backward, given the batch's pack (None: the run's layout)."""
    export_hf: Callable[[Path], None] | None = None
    """Write the model as a Hugging Face folder (a collective), for families that can."""


def build_trained_model(config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
                        meter: CommMeter, stage: int = 0) -> TrainedModel:
    """Build, initialise or load, and parallelize the configured model on this rank (a collective).

    Args:
        stage: this rank's pipeline stage (cpcompose's own families only).
    Raises:
        TrainingError: (exit code 2) a configuration the model cannot take, or a module the exactness probe
            (`parallelism.cp_verify`) finds different under CP; the same on every rank.
    """
    if config.model.name == HF_MODEL:
        from cpcompose.training.hf_model import build_hf_model

        try:
            built = build_hf_model(config, dims=dims, mesh=mesh, device=device, meter=meter)
        except ConfigError as e:  # the pre-launch checks, reached in-rank (a folder changed, or no preflight)
            raise TrainingError(str(e), exit_code=2) from None
        return TrainedModel(module=built.module, cp_scope=built.cp_scope,
                            export_hf=lambda folder: built.export(folder, config))
    return _build_own(config, dims=dims, mesh=mesh, device=device, meter=meter, stage=stage)


def _build_own(config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, device: torch.device, meter: CommMeter,
               stage: int) -> TrainedModel:
    """A family of `cpcompose.models`: identical weights on every rank (initialized whole, then cut and
    parallelized). The style is kept to switch packed layouts per batch (and applied at cp == 1 too, so
    documents stay masked)."""
    c, p = config, config.parallelism
    spec = get_model_spec(c.model.name)
    model = spec.build(c.model, max_seq_len=c.max_seq_len())
    model.init_weights(seed=c.job.seed)
    if dims.pp_enabled:
        model = spec.split_for_pipeline(model, num_stages=dims.pp, stage_index=stage)
    model.to(device)
    if dims.cp_enabled and p.cp_verify and not dims.pp_enabled:
        _verify(model, config, dims=dims, mesh=mesh, device=device)
    return _parallelize_own(model, config, dims=dims, mesh=mesh, meter=meter)


def build_unfilled_model(config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, stage: int = 0) -> TrainedModel:
    """The trainer's model, parallelized, its weights never set (a Hugging Face model from its config.json alone):
    for a rehearsal under FakeTensorMode (`cpcompose.training.rehearsal`), where values do not exist."""
    if config.model.name == HF_MODEL:
        from cpcompose.training.hf_model import build_unfilled_hf_model

        built = build_unfilled_hf_model(config, dims=dims, mesh=mesh)
        return TrainedModel(module=built.module, cp_scope=built.cp_scope)
    spec = get_model_spec(config.model.name)
    model = spec.build(config.model, max_seq_len=config.max_seq_len())
    if dims.pp_enabled:
        model = spec.split_for_pipeline(model, num_stages=dims.pp, stage_index=stage)
    return _parallelize_own(model, config, dims=dims, mesh=mesh, meter=None)


def _parallelize_own(model: nn.Module, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh,
                     meter: CommMeter | None) -> TrainedModel:
    c, p = config, config.parallelism
    style = ContextParallel(p.cp_options(meter=meter), seq_dim=1) if dims.cp_enabled or c.data.pack else None
    model = get_model_spec(c.model.name).parallelize(
        model, parallel_dims=dims, mesh=mesh, cp=style,
        activation_checkpoint=c.activation_checkpoint.mode == "full", torch_compile=c.training.compile,
        offload_activations=c.activation_checkpoint.offload, mlp_tiles=c.training.tiled_mlp,
        param_dtype=compute_dtype(c), offload_params=c.training.offload_params,
    )

    def cp_scope(packed: PackedLayout | None) -> contextlib.AbstractContextManager:
        return style.layout_for(packed) if packed is not None and style is not None else contextlib.nullcontext()

    return TrainedModel(module=model, cp_scope=cp_scope)


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
               options=p.cp_options().replace(layout=p.cp_layout, meter=None))
    except ValueError as e:  # raised on every rank alike: a configuration-like error, printed once
        raise TrainingError(f"parallelism.cp_verify: {e}", exit_code=2) from None
