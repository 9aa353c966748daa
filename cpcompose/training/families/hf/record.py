"""The Hugging Face family's record: a causal LM read from a local folder (`model.name = "hf"`).

The model itself is built by `model.py` (checked before launch, built sharded, loaded slice by slice),
its memory counted by `memory.py`; this record is what the trainer asks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter
from cpcompose.config import ConfigError, JobConfig, Model
from cpcompose.distributed import ParallelDims
from cpcompose.models.spec import MemoryProfile
from cpcompose.training.errors import TrainingError
from cpcompose.training.families.hf.memory import hf_memory_profile
from cpcompose.training.families.hf.model import (
    build_hf_model,
    build_unfilled_hf_model,
    check_hf_model,
    describe_hf_model,
    parallelize_hf_model,
    read_hf_config,
)
from cpcompose.training.families.record import TrainedModel

__all__ = ["HuggingFaceFamily"]


@dataclass(frozen=True)
class HuggingFaceFamily:
    """The record of a transformers causal LM from `model.path`."""

    name: str = "hf"
    reads_folder: bool = True
    exports: bool = True
    rank_imports: tuple[str, ...] = ("cpcompose.integrations.transformers",)

    def refusal(self, config: JobConfig) -> ConfigError | None:
        if config.model.path is None:
            return ConfigError(f"model.path: required with model.name = '{self.name}': a local folder with "
                               "config.json, *.safetensors and the tokenizer files (e.g. one written by save_pretrained)")
        return None

    def resolve(self, config: JobConfig) -> JobConfig:
        """The vocabulary is the folder's (its config.json, read without transformers): what the data's ids are
        checked against; with pipelining the layer count too (`model.n_layers`: what the stages are cut from)."""
        m, ep = config.model, config.parallelism.ep
        fields = _folder_config(Path(m.path))
        vocab = _text_field(fields, "vocab_size")
        if not (isinstance(vocab, int) and vocab > 0):
            raise ConfigError(f"model.path: {m.path}/config.json has no positive vocab_size")
        if ep > 1:
            _check_experts(fields, ep, f"{m.path}/config.json")
        default = Model.__dataclass_fields__["vocab_size"].default
        if m.vocab_size not in (default, vocab):
            raise ConfigError(f"model.vocab_size: does not apply to model.name = '{self.name}': the vocabulary is "
                              f"{m.path}/config.json's ({vocab}); remove it")
        config = replace(config, model=replace(m, vocab_size=vocab))
        if config.parallelism.pp > 1:
            config = _with_layers(config, fields)
        return config

    def check(self, config: JobConfig) -> None:
        check_hf_model(config)

    def describe(self, config: JobConfig) -> tuple[int, str]:
        return describe_hf_model(config)

    def memory_profile(self, config: JobConfig, *, tp: int, precision: str, mlp_tiles: int) -> MemoryProfile:
        return hf_memory_profile(read_hf_config(config), tp=tp, precision=precision, mlp_tiles=mlp_tiles)

    def parallelize(self, model: nn.Module, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh,
                    meter: CommMeter | None) -> TrainedModel:
        return parallelize_hf_model(model, config, dims=dims, mesh=mesh, meter=meter)

    def build(self, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
              meter: CommMeter, stages: tuple[int, ...] = (0,), num_stages: int = 1) -> TrainedModel:
        try:
            return build_hf_model(config, dims=dims, mesh=mesh, device=device, meter=meter, stages=stages,
                                  num_stages=num_stages)
        except ConfigError as e:  # the pre-launch checks, reached in-rank (a folder changed, or no preflight)
            raise TrainingError(str(e), exit_code=2) from None

    def build_unfilled(self, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh,
                       stages: tuple[int, ...] = (0,), num_stages: int = 1) -> TrainedModel:
        return build_unfilled_hf_model(config, dims=dims, mesh=mesh, stages=stages, num_stages=num_stages)


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where the families' config.json keep the number of routed experts per MoE layer (Qwen3-MoE, Qwen3-Next, Jamba:
num_experts; Mixtral, gpt-oss, MiniMax: num_local_experts; DeepSeek-V3, GLM-4.5: n_routed_experts)."""


def _check_experts(fields: dict, ep: int, where: str) -> None:
    """`parallelism.ep` against the folder's experts: a model without experts, or experts that do not split into
    `ep` equal shares, is refused by name (an experts class whose layout cpcompose cannot read is refused when the
    model is built, `model.py`)."""
    experts = next((n for key in EXPERT_COUNT_KEYS if isinstance(n := _text_field(fields, key), int) and n > 0), None)
    if experts is None:
        raise ConfigError(f"parallelism.ep: {ep}: {where} declares no experts ({', '.join(EXPERT_COUNT_KEYS)}): "
                          "expert parallelism needs a mixture-of-experts model; set parallelism.ep = 1")
    if experts % ep:
        raise ConfigError(f"parallelism.ep: {ep} does not divide the model's {experts} experts ({where}): each "
                          "expert-parallel rank holds an equal share; choose a divisor of the expert count")


LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layers", "num_layers", "num_blocks")
"""Where the families' config.json keep their number of decoder layers (most: num_hidden_layers)."""
LAYER_TYPE_KEYS = ("layers_block_type", "layer_types", "block_types")
"""Lists of one entry per layer, for a config.json without a count (Nemotron-H derives num_hidden_layers from its
layers_block_type)."""


def _with_layers(config: JobConfig, fields: dict) -> JobConfig:
    """`model.n_layers` from the folder's config.json (the pipeline's stages are cut from it), refusing another
    value set by hand, then the pipeline settings checked against it (`pipeline_problem`)."""
    from cpcompose.distributed.pipeline import pipeline_problem

    m, where = config.model, f"{config.model.path}/config.json"
    layers = next((n for key in LAYER_COUNT_KEYS if isinstance(n := _text_field(fields, key), int) and n > 0), None)
    if layers is None:  # a family whose count is its list of layer types (Nemotron-H's layers_block_type)
        layers = next((len(t) for key in LAYER_TYPE_KEYS if isinstance(t := _text_field(fields, key), list) and t),
                      None)
    if layers is None:
        raise ConfigError(f"parallelism.pp: {config.parallelism.pp}: {where} declares no layer count "
                          f"({', '.join(LAYER_COUNT_KEYS + LAYER_TYPE_KEYS)}) to cut pipeline stages from; set parallelism.pp = 1")
    default = Model.__dataclass_fields__["n_layers"].default
    if m.n_layers not in (default, layers):
        raise ConfigError(f"model.n_layers: does not apply to model.name = 'hf': the layers are {where}'s ({layers}); "
                          "remove it")
    if (problem := pipeline_problem(config.parallelism, layers)) is not None:  # the folder's layers: not a key to set
        key = "parallelism.pp" if problem[0] == "model.n_layers" else problem[0]
        raise ConfigError(f"{key}: {problem[1]} (the {layers} decoder layers of {where})")
    return replace(config, model=replace(m, n_layers=layers))


def _text_field(fields: dict, key: str) -> object:
    """`key` of a config.json, or of its `text_config` (a multimodal folder's language model)."""
    value = fields.get(key)
    if value is None and isinstance(fields.get("text_config"), dict):
        value = fields["text_config"].get(key)
    return value


def _folder_config(folder: Path) -> dict:
    """The folder's config.json, read without transformers (the resolution step runs before it is imported)."""
    config = folder / "config.json"
    if not folder.is_dir():
        raise ConfigError(f"model.path: {folder} is not a folder (model.name = 'hf' reads a local folder as "
                          "save_pretrained writes it; nothing is downloaded)")
    if not config.is_file():
        raise ConfigError(f"model.path: {folder} has no config.json: not a Hugging Face model folder")
    try:
        fields = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: {config} does not read as JSON ({e})") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"model.path: {config} is not a JSON object")
    return fields
