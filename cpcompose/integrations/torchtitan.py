"""torchtitan's language models with cpcompose as their context parallelism (install `cpcompose[torchtitan]`).

Three pieces, each through an extension point torchtitan offers, none patching it:

* `CPComposeAttention`, an inner attention (torchtitan's `Module` with a `Config`)
  that `use_cpcompose_attention` puts in place of a model config's flex / varlen /
  SDPA inner attention. Its `forward` takes torchtitan's inner-attention call
  (`q, k, v` as `(batch, seq, heads, head_dim)`, `attention_masks=`, `scale=`,
  `enable_gqa=`) and runs cpcompose's CP attention on the local shards: causal,
  within documents, with GQA K/V and MLA's narrower V heads as they are.
* `cpcompose_parallelize(parallelize_fn)`, a `ModelSpec.parallelize_fn` wrapper: it
  checks that every attention is cpcompose's, tells each the CP degree, and runs the
  model's own parallelize (TP, AC, compile, FSDP over dp_shard x cp) with
  torchtitan's CP wrapping turned off, since cpcompose does CP.
* `CPComposeTrainer`, torchtitan's `Trainer` with `post_dataloading_process`
  overridden to split each batch with `shard_batch` (documents from torchtitan's
  per-document positions, the balanced packed split) and to hand the attention its
  mask: a `CPAttentionMask` in torchtitan's own `attention_masks` argument, which
  reaches every layer, pipeline stage and activation-checkpoint recompute.

`with_cpcompose(config)` turns any torchtitan `Trainer.Config` into a
`CPComposeTrainer.Config`; this module is also a torchtitan config registry, so
`--module cpcompose.integrations.torchtitan --config llama3_debugmodel` runs
torchtitan's own `llama3_debugmodel` (or any config of its llama3, qwen3 and
deepseek_v3 registries) with cpcompose CP, set by `--cpcompose.strategy` etc.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

try:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention
    from torchtitan.protocols.module import Module
    from torchtitan.trainer import Trainer
except ImportError as e:  # an optional dependency: say which extra brings it
    raise ImportError(
        "cpcompose.integrations.torchtitan needs torchtitan 0.3.0 (pip install 'cpcompose[torchtitan]'); "
        f"torchtitan imports triton, which CUDA machines have: {e}"
    ) from e

from cpcompose.integrations._titan_batch import CPAttentionMask, CPComposeConfig, TitanBatch, shard_batch

__all__ = [
    "CPAttentionMask",
    "CPComposeAttention",
    "CPComposeConfig",
    "CPComposeTrainer",
    "TitanBatch",
    "cpcompose_parallelize",
    "shard_batch",
    "use_cpcompose_attention",
    "with_cpcompose",
]

_REPLACED = (FlexAttention.Config, VarlenAttention.Config, ScaledDotProductAttention.Config)
_REGISTRIES = ("llama3", "qwen3", "deepseek_v3")  # the models whose configs `--module` wraps by name


class CPComposeAttention(Module):
    """torchtitan inner attention computed by cpcompose: CP attention under CP, SDPA on one process.

    Under CP, `attention_masks` must be the `CPAttentionMask` of `shard_batch` (the
    trainer passes it); it carries the mesh and this batch's split, documents included.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.cp_degree = 1  # set by cpcompose_parallelize: under CP a mask without a region is an error

    def forward(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: object = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        score_mod: object = None,
        out_transform: object = None,
        **kwargs: Any,
    ) -> Tensor:
        """torchtitan's inner-attention call; returns `(batch, seq, heads, v_head_dim)`.

        Raises:
            ValueError: on every CP rank before any K/V moves (one process: at once), for
                what cpcompose cannot honour: a flex `score_mod`, an `out_transform` (sinks),
                DTensor inputs, or a mask that is not `shard_batch`'s.
        """
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        mask = attention_masks
        region = mask.region if isinstance(mask, CPAttentionMask) else None
        error = _refusal(q_BLNH, score_mod, out_transform)
        if region is not None:
            return region.attend(q, k, v, is_causal=is_causal, scale=scale, caller_error=error).transpose(1, 2)
        error = error or _mask_refusal(mask, self.cp_degree)
        if error:
            raise ValueError(f"CPComposeAttention: {error}")
        assert mask is None or isinstance(mask, CPAttentionMask)
        return _local_attention(q, k, v, mask, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal).transpose(1, 2)


def _refusal(q: Tensor, score_mod: object, out_transform: object) -> str | None:
    if score_mod is not None:
        return "a flex score_mod cannot be applied by CP attention; use a model without one"
    if out_transform is not None:
        return "out_transform (an LSE epilogue such as gpt-oss's attention sinks) is not supported"
    if isinstance(q, DTensor):
        return (
            "got DTensor q/k/v; cpcompose attends local tensors: use parallelism.spmd_backend='partial_dtensor'"
        )
    return None


def _mask_refusal(mask: object, cp_degree: int) -> str | None:
    if mask is not None and not isinstance(mask, CPAttentionMask):
        return (
            f"attention_masks is a {type(mask).__name__} (torchtitan's flex/varlen mask); build the batch with "
            "cpcompose.integrations.torchtitan.shard_batch (CPComposeTrainer does) so the mask is a CPAttentionMask"
        )
    if cp_degree > 1:
        return (
            f"context_parallel_degree is {cp_degree} but attention_masks carries no CP region, so attention would "
            "see this rank's tokens only: split the batch with shard_batch(..., mesh=cp_mesh) (CPComposeTrainer "
            "does; torchtitan's validator does not, so keep validator.enable off under cpcompose CP)"
        )
    return None


def _local_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: CPAttentionMask | None, *, scale: float | None, enable_gqa: bool,
    is_causal: bool,
) -> Tensor:
    """One process: SDPA, with an explicit mask for documents and windows (same rule as the CP path).

    The mask is `(batch, seq, seq)` booleans: meant for CP degree 1 runs of the same
    config (evaluation, small jobs); long single-device training is torchtitan's flex's job.
    """
    if mask is None or (mask.document_ids is None and mask.window is None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    seq = q.shape[2]
    i = torch.arange(seq, device=q.device)[:, None]
    j = torch.arange(seq, device=q.device)[None]
    allowed = j <= i if is_causal else torch.ones(seq, seq, dtype=torch.bool, device=q.device)
    if mask.window is not None:
        allowed = allowed & ((i - j).abs() <= mask.window)
    allowed = allowed[None, None]
    if mask.document_ids is not None:
        ids = mask.document_ids
        allowed = allowed & (ids[:, None, :, None] == ids[:, None, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)


def use_cpcompose_attention(model_config: Module.Config) -> Module.Config:
    """A copy of a torchtitan model config with every flex / varlen / SDPA inner attention made cpcompose's.

    Raises:
        ValueError: the config holds none of them.
    """
    config = copy.deepcopy(model_config)
    found = [(parent, attr) for _, cfg, parent, attr in config.traverse(Module.Config, recurse=True)
             if isinstance(cfg, _REPLACED)]
    if not found:
        raise ValueError(
            f"{type(model_config).__qualname__} has no FlexAttention / VarlenAttention / ScaledDotProductAttention "
            "inner attention for cpcompose to replace"
        )
    for parent, attr in found:
        if isinstance(parent, list):
            parent[attr] = CPComposeAttention.Config()
        else:
            setattr(parent, attr, CPComposeAttention.Config())
    return config


class _CPLeftToCpcompose:
    """`parallel_dims` as the model's parallelize sees it: CP off (cpcompose does it), all else as it is.

    Only the `cp_enabled` read by torchtitan's parallelize functions (to wrap the inner
    attention with its own CP) changes; derived properties (FSDP over dp_shard x cp,
    the loss mesh) are still computed by the real object.
    """

    cp_enabled = False

    def __init__(self, dims: Any) -> None:
        self._dims = dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)


def cpcompose_parallelize(parallelize_fn: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """Wrap a `ModelSpec.parallelize_fn` so cpcompose, not torchtitan, does the model's CP.

    Raises:
        ValueError: an attention layer's inner attention is not `CPComposeAttention`
            (build the config with `use_cpcompose_attention` / `with_cpcompose`).
    """

    @functools.wraps(parallelize_fn)
    def parallelize(model: torch.nn.Module, *, parallel_dims: Any, **kwargs: Any) -> torch.nn.Module:
        backend_error = _backend_error(kwargs.get("parallelism"))
        if backend_error:
            raise ValueError(f"cpcompose_parallelize: {backend_error}")
        others = [name for name, m in model.named_modules()
                  if isinstance(m, (FlexAttention, VarlenAttention, ScaledDotProductAttention))]
        ours = [m for m in model.modules() if isinstance(m, CPComposeAttention)]
        if others or not ours:
            raise ValueError(
                f"cpcompose_parallelize: inner attention {others[:3] or 'missing'} is not CPComposeAttention; "
                "build the model config with cpcompose.integrations.torchtitan.use_cpcompose_attention"
            )
        degree = parallel_dims.cp if parallel_dims.cp_enabled else 1
        for module in ours:
            module.cp_degree = degree
        return parallelize_fn(model, parallel_dims=_CPLeftToCpcompose(parallel_dims), **kwargs)

    return parallelize


def _backend_error(parallelism: Any) -> str | None:
    """cpcompose attends plain local tensors: torchtitan's DTensor-for-model-parallel-axes backend."""
    backend = getattr(parallelism, "spmd_backend", "partial_dtensor")
    if backend != "partial_dtensor":
        return (
            f"parallelism.spmd_backend={backend!r}: cpcompose CP runs with 'partial_dtensor' (with_cpcompose sets "
            "it; torchtitan 0.3.0's default is 'spmd_types')"
        )
    return None


class CPComposeTrainer(Trainer):
    """torchtitan's Trainer, each batch split by cpcompose (`shard_batch`) instead of torchtitan's CP."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        cpcompose: CPComposeConfig = field(default_factory=CPComposeConfig)
        """cpcompose's CP settings (strategy, documents, balance, layout, window)."""

    def post_dataloading_process(
        self, input_dict: dict[str, Tensor], labels: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """This rank's inputs and labels, and the model kwargs (`positions`, `attention_masks`)."""
        backend_error = _backend_error(self.config.parallelism)
        if backend_error:
            raise ValueError(f"CPComposeTrainer: {backend_error}")
        extra = {k: v for k, v in input_dict.items() if k != "input"}
        mesh = self.parallel_dims.get_mesh("cp") if self.parallel_dims.cp_enabled else None
        batch = shard_batch(input_dict["input"], labels, extra.get("positions"), mesh, self.config.cpcompose)
        extra.update(positions=batch.positions, attention_masks=batch.attention_masks)
        self.ntokens_seen += batch.labels.numel()
        return batch.inputs, batch.labels, extra


def with_cpcompose(config: Trainer.Config, **settings: Any) -> CPComposeTrainer.Config:
    """A torchtitan trainer config run with cpcompose CP: attention replaced, parallelize wrapped.

    Args:
        config: e.g. `torchtitan.models.llama3.config_registry.llama3_8b()`.
        **settings: `CPComposeConfig` fields (`strategy="alltoall"`, `window=4096`, ...).
    """
    spec = config.model_spec
    if spec is None:
        raise ValueError("with_cpcompose: the trainer config has no model_spec")
    model_spec = dataclasses.replace(
        spec, model=use_cpcompose_attention(spec.model), parallelize_fn=cpcompose_parallelize(spec.parallelize_fn)
    )
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values.update(
        model_spec=model_spec,
        parallelism=dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor"),
        cpcompose=CPComposeConfig(**settings),
    )
    return CPComposeTrainer.Config(**values)


def _wrapped(make: Callable[[], Trainer.Config]) -> Callable[[], CPComposeTrainer.Config]:
    return functools.wraps(make)(lambda: with_cpcompose(make()))


def __getattr__(name: str) -> Callable[[], CPComposeTrainer.Config]:
    """torchtitan's `--config NAME` from this module: NAME of the llama3 / qwen3 / deepseek_v3 registries, wrapped."""
    for model in () if name.startswith("_") else _REGISTRIES:
        registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        make = getattr(registry, name, None)
        if callable(make):
            return _wrapped(make)
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r} (nor do torchtitan's {_REGISTRIES} registries)"
    )
