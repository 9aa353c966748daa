"""A Hugging Face causal LM under the trainer (`model.name = "hf"`): checked before launch, built sharded.

Built on the meta device with `attn_implementation="cpcompose"`, then made parallel in the
trainer's order: pipeline stages (`parallelism.pp`: the model cut to this rank's stages at its decoder layers,
`integrations.transformers.pipeline`, each stage entering its microbatch's CP region), CP (a `context_parallel` region around each micro-batch's forward and backward,
driven by the trainer's own split of the batch: `cp_scope`), expert parallelism (`parallelism.ep`: each
experts module swapped for its EP form, this rank's block of experts), tensor parallelism (`parallelism.tp`:
the layers split as the family's plan says, `tensor_parallel.py`), sequence-tiled MLPs, activation
checkpointing whose recomputation re-enters the region (`recompute_context`), FSDP2 over
dp_shard x cp (the experts over the experts' mesh `efsdp` axis, dp_shard x cp / ep). Only then is memory allocated (`to_empty`): the buffers no checkpoint holds are
recomputed, and each rank reads its own slices of the weights from `model.path`
(`load_pretrained_weights`), so no rank ever holds the whole model. `training.compile` compiles each
decoder layer (`compile.py`, which names the families it refuses).

Everything that can be checked without ranks is checked by `check_hf_model` before launch (the
folder, the family, the overrides, the length, the weights' names and shapes, the loss head,
refused layers); the ranks run the same checks while building, so a folder changed in between
fails alike on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter
from cpcompose.config import ConfigError, JobConfig, cp_options
from cpcompose.distributed import (ExpertShards, ParallelDims, apply_activation_checkpointing, apply_fsdp,
                                   apply_tiled_mlp, fsdp_wanted)
from cpcompose.layouts import PackedLayout
from cpcompose.parallel import context_parallel, recompute_context
from cpcompose.training.errors import TrainingError
from cpcompose.training.families.export import check_export_folder, export_folder
from cpcompose.training.families.hf.compile import apply_hf_compile, compile_refusal
from cpcompose.training.families.hf.router_loss import router_loss_of
from cpcompose.training.families.hf.tensor_parallel import apply_hf_tensor_parallel, check_hf_tensor_parallel
from cpcompose.training.families.record import TrainedModel
from cpcompose.training.units import human_count
from cpcompose.training.mixed_precision import compute_dtype

__all__ = ["build_hf_model", "build_unfilled_hf_model", "check_hf_model", "describe_hf_model",
           "parallelize_hf_model", "read_hf_config"]


def _hf() -> Any:
    """The integration (and with it transformers), imported only for model.name = "hf"."""
    try:
        import cpcompose.integrations.transformers as cphf
    except ImportError as e:
        missing = any(isinstance(x, ModuleNotFoundError) and (x.name or "").split(".")[0] == "transformers"
                      for x in (e, e.__cause__))
        raise ConfigError("model.name: 'hf' needs the hf extra (transformers" + (", not installed" if missing else
                          f": {e}") + '): pip install -e ".[hf]" in cpcompose\'s folder, or pip install '
                          '"cpcompose[hf]"') from None
    return cphf


@dataclass
class _Prepared:
    """What the checks produce and the build uses: the config as trained, the meta model, its parts."""

    config: Any  # the transformers config with the overrides (what an export writes)
    model: nn.Module  # on the meta device
    layers: list[nn.Module]  # the decoder layers: FSDP units, checkpointed blocks
    plan: Any  # cphf.WeightPlan (None when only config.json was read)


def read_hf_config(config: JobConfig) -> Any:
    """model.path's transformers config with model.rope_theta / rope_scaling / max_position_embeddings applied."""
    _hf()  # without transformers, the one line that says so
    from transformers import AutoConfig

    m = config.model
    try:
        hf_config = AutoConfig.from_pretrained(m.path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.path: {m.path} does not load as a transformers config: {e}") from None
    try:
        return _hf().extend_context(hf_config, rope_theta=m.rope_theta, rope_scaling=m.rope_scaling,
                                    max_position_embeddings=m.max_position_embeddings)
    except ValueError as e:
        raise ConfigError(f"model.{e}") from None


def _uses_region(config: JobConfig) -> bool:
    return config.parallelism.cp > 1 or config.data.pack


def _prepare(config: JobConfig, *, weights: bool = True) -> _Prepared:
    """Every check that needs no ranks, and the meta model they leave (`weights=False`: from config.json alone,
    without the safetensors headers, for a dry run before the weights are downloaded).

    Raises:
        ConfigError: naming the key to change.
    """
    cphf, m, t = _hf(), config.model, config.training  # first: without transformers, the one line that says so
    from transformers import AutoModelForCausalLM

    hf_config = read_hf_config(config)
    model_type = getattr(hf_config, "model_type", None)
    if model_type in cphf.attention.OWN_ATTENTION:
        raise ConfigError(f"model.path: {cphf.attention.OWN_ATTENTION[model_type]}")
    for key in _JITTER_KEYS:  # random per token: one process and the CP ranks would draw different noise
        if _uses_region(config) and float(getattr(hf_config, key, 0.0) or 0.0) > 0:
            raise ConfigError(f"model.path: {m.path}/config.json sets {key} = {getattr(hf_config, key)} (random "
                              "noise on the router's input in training), which CP cannot reproduce; set it to 0 in "
                              "config.json")
    if _uses_region(config) and float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ConfigError(f"model.path: {m.path}/config.json sets attention_dropout = {hf_config.attention_dropout}, "
                          "which CP attention does not apply; set it to 0 in config.json")
    limit = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(limit, int) and t.seq_len > limit:
        raise ConfigError(
            f"training.seq_len: {t.seq_len:,} exceeds the model's max_position_embeddings {limit:,} "
            f"({'model.max_position_embeddings' if m.max_position_embeddings else m.path + '/config.json'}); "
            "to extend the context set --model.max_position_embeddings and a RoPE change (model.rope_scaling, e.g. "
            "yarn with factor = seq_len / the original length, or model.rope_theta), or lower training.seq_len"
        )
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=torch.float32,
                                                     attn_implementation=cphf.ATTN_IMPLEMENTATION)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"model.path: transformers cannot build a causal LM ({type(e).__name__}) from "
                          f"{m.path}/config.json{' with the model.rope_* overrides' if m.rope_scaling else ''}: {e}") \
            from None
    router_loss_of(model, where=f"{m.path}/config.json")  # refused by name before launch
    layers = _decoder_layers(model)
    if layers is None:
        raise ConfigError(f"model.path: {type(model).__name__} has no decoder layers at model.{model.base_model_prefix}"
                          ".layers (or .blocks), which the trainer shards and checkpoints one by one (a multimodal "
                          "model? give the text model's folder)")
    if config.parallelism.pp > 1:
        _check_pipeline(model, config, len(layers))
    if t.tiled_block > 1:
        raise ConfigError("training.tiled_block: tiles the own Llama's blocks; a Hugging Face model's layers are its "
                          "own code: set training.tiled_block = 1 (training.tiled_mlp tiles their feed-forward)")
    if t.tiled_mlp > 1 and any(_mlp(layer) is None for layer in layers):
        raise ConfigError(f"training.tiled_mlp: {type(layers[0]).__name__} has no .mlp or .feed_forward to tile; set "
                          "training.tiled_mlp = 1")
    if config.parallelism.ep > 1:
        _check_expert_parallel(model, config)
    if config.parallelism.tp > 1:
        check_hf_tensor_parallel(model, layers, config)
    if _uses_region(config) and (refused := cphf.refused_in(model)):
        raise ConfigError("model.path: cpcompose cannot make this model exact under CP (parallelism.cp > 1 or "
                          "data.pack): " + "; ".join(refused))
    if t.compile and (why := compile_refusal(model, hf_config, ep=config.parallelism.ep,
                                                           pp=config.parallelism.pp)):
        raise ConfigError(f"training.compile: {why}; set training.compile = false")
    if t.fused_loss:
        try:
            cphf.causal_lm_head(model)
        except ValueError as e:
            raise ConfigError(f"training.fused_loss: {e} (set --training.fused_loss=false)") from None
    try:
        plan = cphf.weight_plan(model, m.path) if weights else None
    except ValueError as e:
        raise ConfigError(f"model.path: {e}") from None
    return _Prepared(hf_config, model, list(layers), plan)


_JITTER_KEYS = ("router_jitter_noise", "input_jitter_noise")
"""Where MoE families keep their training-time routing noise (Mixtral, MiniMax: router_jitter_noise; PhiMoE: both)."""


def num_pipeline_stages(config: JobConfig, n_layers: int) -> int:
    """The stages the model is cut into: `parallelism.pp` x the stages each rank runs (1 without pipelining)."""
    p = config.parallelism
    if p.pp == 1:
        return 1
    from cpcompose.distributed.pipeline import stages_per_rank

    return p.pp * stages_per_rank(p, n_layers)


def _check_pipeline(model: nn.Module, config: JobConfig, n_layers: int) -> None:
    """`parallelism.pp` > 1: the model cuts into its stages at decoder layers (`pipeline_refusal`), and trains no
    router loss: transformers' load-balancing loss pools every MoE layer's statistics before their product, which
    the stages hold apart.

    Raises:
        ConfigError: naming the key to change.
    """
    from cpcompose.integrations.transformers.pipeline import pipeline_refusal, stages_without_token_mixing

    p = config.parallelism
    stages = num_pipeline_stages(config, n_layers)
    if (refusal := pipeline_refusal(model, stages)) is not None:
        raise ConfigError(f"parallelism.pp: {p.pp} ({stages} stages under {p.pp_schedule}): {refusal}")
    if _uses_region(config) and (idle := stages_without_token_mixing(model, stages)):
        raise ConfigError(f"parallelism.pp: {p.pp} ({stages} stages under {p.pp_schedule}): stage {idle[0]} holds "
                          "feed-forward layers alone, whose CP region would route no attention or mixer (which CP "
                          "refuses as attention run on a shard); choose parallelism.pp or "
                          "parallelism.pp_layers_per_stage so that every stage holds a token-mixing layer")
    if router_loss_of(model) is not None:
        raise ConfigError(f"parallelism.pp: {p.pp}: {config.model.path}/config.json sets output_router_logits = true, "
                          "and the router loss pools every MoE layer's statistics, which the pipeline stages hold "
                          "apart; set output_router_logits = false in config.json, or parallelism.pp = 1")


def _check_expert_parallel(model: nn.Module, config: JobConfig) -> None:
    """`parallelism.ep` > 1: every experts module's layout is one cpcompose reads. Checkpoints and the export
    need nothing more: they see each rank's block of experts as part of the whole tensor (`ExpertShards`).

    Raises:
        ConfigError: no experts module, or a layout not declared (the class named).
    """
    from cpcompose.integrations.transformers.expert_parallel import experts_modules
    from cpcompose.integrations.transformers.experts import read_experts

    ep, where = config.parallelism.ep, f"{config.model.path}"
    found = experts_modules(model)
    if not found:
        raise ConfigError(f"parallelism.ep: {ep}: {type(model).__name__} ({where}) has no experts module cpcompose "
                          "recognises; set parallelism.ep = 1")
    for name, module in found:
        try:
            read_experts(module)
        except ValueError as e:
            raise ConfigError(f"parallelism.ep: {ep}: {name}: {e}; set parallelism.ep = 1") from None


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The base model's stack of layers: `.layers` (most families) or `.blocks` (RWKV, xLSTM); None if neither."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    for name in ("layers", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return layers
    return None


def _unshared(layers: list[nn.Module]) -> list[nn.Module]:
    """The layers that share no parameter with another layer: FSDP's units. A block shared between layers
    (Zamba's one attention block in every hybrid layer) cannot be in two units; those layers stay in the root's."""
    seen: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            seen.setdefault(id(p), i)
    shared = {i for i, layer in enumerate(layers) for p in layer.parameters() if seen[id(p)] != i}
    shared |= {seen[id(p)] for i in shared for p in layers[i].parameters()}
    return [layer for i, layer in enumerate(layers) if i not in shared]


def _outer_units(model: nn.Module) -> tuple[nn.Module | None, list[nn.Module]]:
    """The FSDP units around the decoder layers, as torchtitan makes them: the input embedding alone, and the
    final norm with the output layer. Tied embeddings (one weight in both) stay in the root unit with the norm."""
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embedding, nn.Module) or not isinstance(output, nn.Module):
        return None, []
    if any(p is q for p in embedding.parameters() for q in output.parameters()):
        return None, []
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    norm = next((m for m in (getattr(base, name, None) for name in _FINAL_NORMS) if isinstance(m, nn.Module)), None)
    if norm is None:  # the fused loss never calls lm_head: only the norm's forward gathers their unit, so without
        return embedding, []  # a norm the output layer stays in the root unit, gathered from the forward's start
    return embedding, [norm, output]


_FINAL_NORMS = ("norm", "norm_f", "final_layernorm", "final_norm", "ln_f", "ln_out", "out_norm")
"""The names families give the base model's last norm, which runs right before `lm_head` (Mamba's `norm_f`,
Jamba's `final_layernorm`, RWKV's `ln_out`, xLSTM's `out_norm`, ...)."""


def _mlp(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's feed-forward (`mlp`, or LFM2's `feed_forward`): token-wise, so it can be tiled."""
    for name in ("mlp", "feed_forward"):
        if isinstance(getattr(layer, name, None), nn.Module):
            return getattr(layer, name)
    return None


def check_hf_model(config: JobConfig) -> None:
    """The pre-launch checks of a `model.name = "hf"` run (reads config.json and the safetensors headers).

    Raises:
        ConfigError: naming the key to change.
    """
    prepared = _prepare(config)
    export = export_folder(config)
    if export is None:
        return
    if export.resolve() == Path(config.model.path).resolve():
        raise ConfigError(f"checkpoint.export_hf: {export} is model.path itself, and the export would overwrite the "
                          "model it loads; choose another folder")
    integer = [k for k in prepared.plan.stored_names() if not prepared.plan.stored[k].dtype.is_floating_point]
    if integer:  # torch's safetensors consolidation (torch.distributed.checkpoint) sizes every tensor with finfo
        raise ConfigError(f"checkpoint.export_hf: the model stores integer tensors ({integer[0]}, ...), which torch's "
                          "distributed safetensors writer cannot consolidate yet; unset checkpoint.export_hf and "
                          "convert the DCP checkpoint (checkpoint.enable) instead")
    check_export_folder(config)


def describe_hf_model(config: JobConfig) -> tuple[int, str]:
    """(parameters, one line) for the dry run (config.json is enough: the weights' headers are not read)."""
    prepared = _prepare(config, weights=False)
    c = prepared.config
    n = sum(p.numel() for p in {id(p): p for p in prepared.model.parameters()}.values())  # tied: once
    heads = (f", {c.num_attention_heads} heads, {getattr(c, 'num_key_value_heads', '?')} kv heads"
             if isinstance(getattr(c, "num_attention_heads", None), int) else "")  # an SSM has none
    limit = getattr(c, "max_position_embeddings", None)  # Mamba, Mamba2, RecurrentGemma have none
    length = f", max_position_embeddings {limit:,}" if isinstance(limit, int) else ""
    return n, (f"hf {type(prepared.model).__name__} from {config.model.path}, {human_count(n)} parameters "
               f"({len(prepared.layers)} layers, hidden {getattr(c, 'hidden_size', '?')}{heads}{length})")


class _TrainerForward:
    """The trainer's call on a transformers causal LM: `forward(tokens, position_ids, *, head=None,
    router_logits=False)`.

    Without `head` it returns the model's logits (whatever the family does to them). With it, it cuts
    the model at its output layer (`causal_lm_head`, inside this forward so FSDP has gathered the output
    weight) and returns `head(hidden, weight, bias=, softcap=)`, the fused loss. `router_logits=True`: and every
    MoE layer's router logits of these tokens beside it (no `labels` are passed, so transformers adds no router
    loss of its own: the trainer's is over the whole micro-batch, `router_loss_of`).
    """

    def forward(self, input_ids: Tensor | None = None, position_ids: Tensor | None = None, *,
                head: Callable[..., Tensor] | None = None, router_logits: bool = False,
                **kwargs: Any) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
        kwargs.setdefault("use_cache", False)
        if router_logits:  # every MoE layer's, recorded by transformers (its OutputRecorder on the routers)
            kwargs["output_router_logits"] = True
        if head is None:
            out = super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)  # type: ignore[misc]
            return (out.logits, tuple(out.router_logits)) if router_logits else out.logits
        body = _hf().causal_lm_head(self).body(input_ids=input_ids, position_ids=position_ids, **kwargs)
        cut = _hf().causal_lm_head(self)  # after the body: the final norm's FSDP unit has gathered the output weight
        x, weight, bias = cut.linear_inputs(body.last_hidden_state)
        loss = head(x, weight, bias=bias, softcap=cut.softcap)
        return (loss, tuple(body.router_logits)) if router_logits else loss


@functools.cache
def _trainer_class(cls: type) -> type:
    return type(f"Trained{cls.__name__}", (_TrainerForward, cls), {})


def build_hf_model(config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
                   meter: CommMeter, stages: tuple[int, ...] = (0,), num_stages: int = 1) -> TrainedModel:
    """Build, parallelize and load model.path's model on this rank (a collective: every rank calls it).

    Raises:
        ConfigError: what `check_hf_model` raises (the same on every rank).
        TrainingError: (exit code 2) `parallelism.cp_verify`'s probe found a module that differs under CP (every
            rank).
    """
    cphf, p = _hf(), config.parallelism
    prepared = _prepare(config)
    trained = parallelize_hf_model(prepared.model, config, dims=dims, mesh=mesh, meter=meter, stages=stages,
                                   num_stages=num_stages)
    model = trained.module
    model.to_empty(device=device)
    plan = prepared.plan
    if num_stages > 1:  # this rank's stages' tensors alone; buffers set walking its own layers only
        from cpcompose.integrations.transformers.pipeline import held_layers_only

        with held_layers_only(model):
            cphf.init_non_persistent_buffers(model)
        plan = plan.of_names(set(model.state_dict()))
    else:
        cphf.init_non_persistent_buffers(model)
    if dims.ep_enabled:  # each rank reads its own block of experts
        from cpcompose.integrations.transformers.expert_parallel import expert_blocks

        plan = plan.of_expert_blocks(expert_blocks(model))
    cphf.load_pretrained_weights(model, config.model.path, plan)
    if dims.cp_enabled and p.cp_verify and num_stages == 1:  # the probe runs the whole model (as the own Llama's)
        try:
            with torch.compiler.set_stance("force_eager"):  # the probe's hooks would recompile compiled layers
                cphf.verify(model, mesh["cp"], options=_options(config, meter=None))
        except ValueError as e:  # raised on every rank alike: a configuration-like error, printed once
            raise TrainingError(f"parallelism.cp_verify: {e}", exit_code=2) from None

    def export(folder: Path) -> None:  # a collective: every rank calls it
        state = model.state_dict()
        if trained.expert_shards is not None:  # each expert written from its rank, under the whole tensor's name
            state = trained.expert_shards.view(state)["model"]
        held = prepared.plan.of_names(set(state)) if num_stages > 1 else None  # a pipeline rank: its stages'
        cphf.export_pretrained(model, folder, source=config.model.path, config=prepared.config, plan=prepared.plan,
                               state=state, held=held)

    return dataclasses.replace(trained, export=export)


def build_unfilled_hf_model(config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, stages: tuple[int, ...] = (0,),
                            num_stages: int = 1) -> TrainedModel:
    """model.path's model from its config.json alone, parallelized as `build_hf_model` does, its weights never read:
    for a rehearsal under FakeTensorMode (`cpcompose.training.memory.rehearsal`), which makes its tensors without storage.

    Raises:
        ConfigError: what `check_hf_model` raises for the folder's config.json.
    """
    prepared = _prepare(config, weights=False)
    trained = parallelize_hf_model(prepared.model, config, dims=dims, mesh=mesh, meter=None, stages=stages,
                                   num_stages=num_stages)
    trained.module.to_empty(device=torch.device("cpu"))  # buffers left unset: their values are read, fake ones have none
    return trained


def _expert_split(model: nn.Module) -> tuple[tuple[nn.Parameter, ...], Any]:
    """(the parameters each EP rank holds a different block of, the EP process group) of a model made parallel with
    `parallelism.ep` > 1; ((), None) without expert parallelism."""
    from cpcompose.integrations.transformers.expert_parallel import ExpertParallelExperts, expert_parameter_names

    names = expert_parameter_names(model)
    if not names:
        return (), None
    group = next(m.group.group for m in model.modules() if isinstance(m, ExpertParallelExperts))
    return tuple(p for n, p in model.named_parameters() if n in names), group


def _options(config: JobConfig, *, meter: CommMeter | None) -> Any:
    """The run's CP options, the probe off: it runs once when the model is built, not again on first use."""
    return cp_options(config.parallelism, meter=meter).replace(verify=False)


def parallelize_hf_model(model: nn.Module, config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh,
                         meter: CommMeter | None, stages: tuple[int, ...] = (0,), num_stages: int = 1) -> TrainedModel:
    """The trainer's forward, tiled MLPs, activation checkpointing and FSDP2 on the meta model, in place, with the
    CP region of each micro-batch (`cp_scope`). With `num_stages` > 1 the model is first cut to this rank's
    `stages` (`split_causal_lm`: the rest of the model never gets memory), each a `TrainedModel.stages` module
    entering the CP region of its microbatch around its own forward (`StageModule`), and an FSDP root of its own."""
    t, layers = config.training, list(_decoder_layers(model) or ())
    model.__class__ = _trainer_class(type(model))
    model.train()
    bodies: tuple[nn.Module, ...] = ()
    if num_stages > 1:
        from cpcompose.integrations.transformers.pipeline import split_causal_lm

        bodies = split_causal_lm(model, num_stages=num_stages, stages=stages)
        kept = {id(layer) for body in bodies for layer in body.layers.values()}
        layers = [layer for layer in layers if id(layer) in kept]  # in the model's order
    experts, expert_mesh, shards = [], None, None
    if dims.ep_enabled:
        from cpcompose.integrations.transformers.expert_parallel import apply_expert_parallel, expert_parameter_names

        expert_mesh = dims.build_expert_mesh(mesh)
        swapped = apply_expert_parallel(model, expert_mesh["ep"], meter=meter)
        experts = [model.get_submodule(name) for name in swapped]
        shards = ExpertShards(expert_mesh, frozenset(expert_parameter_names(model)))  # checkpoints, the export
    if dims.tp_enabled:  # before FSDP, which shards the split tensors over dp_shard x cp on top
        apply_hf_tensor_parallel(model, layers, config, mesh)
    apply_tiled_mlp([_mlp(layer) for layer in layers], tiles=t.tiled_mlp)
    if config.activation_checkpoint.mode == "full":
        # CP lives in a region (a TorchFunctionMode), not in hooks: the recomputation must re-enter it.
        apply_activation_checkpointing(layers, offload=config.activation_checkpoint.offload,
                                       context_fn=recompute_context)
    if t.compile:  # `_prepare` refused the families that do not compile
        apply_hf_compile(layers, checkpointed=config.activation_checkpoint.mode == "full")
    cp_scope = _cp_scope(config, dims=dims, mesh=mesh, options=_options(config, meter=meter))
    roots: tuple[nn.Module, ...] = ()
    if bodies:
        from cpcompose.distributed.pipeline_stage import StageModule

        roots = tuple(StageModule(body, cp_scope, dims.cp) for body in bodies)
    if fsdp_wanted(dims, offload_params=t.offload_params):  # tp alone: FSDP over one rank, so every parameter is a
        # DTensor (the fused AdamW step takes no mix of DTensors and plain tensors); offload_params alone: FSDP2's
        # CPUOffloadPolicy over one rank
        embedding, head = _stage_units(bodies) if bodies else _outer_units(model)
        apply_fsdp(model, _unshared(layers), mesh=mesh, parallel_dims=dims, embedding=embedding, head=head,
                   param_dtype=compute_dtype(config), offload_params=t.offload_params, experts=experts,
                   expert_mesh=expert_mesh, **({"roots": roots} if roots else {}))
    expert_parameters, ep_group = _expert_split(model)
    return TrainedModel(module=model, cp_scope=cp_scope, expert_parameters=expert_parameters, ep_group=ep_group,
                        expert_shards=shards, router_loss=router_loss_of(model), **({"stages": roots} if roots else {}))


def _stage_units(bodies: tuple[nn.Module, ...]) -> tuple[nn.Module | None, list[nn.Module]]:
    """The FSDP units around a rank's stages' layers: the first stage's embedding alone, the last stage's final norm
    with the output layer (`_outer_units`' units, where this rank holds them)."""
    embedding = next((body.embed for body in bodies if body.embed is not None), None)
    head = [m for body in bodies for m in (body.norm, body.lm_head)
            if m is not None and any(True for _ in m.parameters())]
    return embedding, head


def _cp_scope(config: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh,
              options: Any) -> Callable[[PackedLayout | None], contextlib.AbstractContextManager]:
    """The `context_parallel` region of a micro-batch's split (cp > 1, or a pack), else nothing."""
    p = config.parallelism
    cp_mesh = mesh["cp"]

    def cp_scope(packed: PackedLayout | None) -> contextlib.AbstractContextManager:
        if packed is None and not dims.cp_enabled:
            return contextlib.nullcontext()
        return context_parallel(cp_mesh, options=options.replace(layout=packed if packed is not None else p.cp_layout))

    return cp_scope
