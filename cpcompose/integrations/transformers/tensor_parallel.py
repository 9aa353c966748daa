"""A Hugging Face decoder's layers under tensor parallelism, as the family's own plan says.

transformers writes each family's tensor-parallel plan down (`config.base_model_tp_plan`, kept by the base
model as `_tp_plan`): module patterns, each with the name of one of transformers' styles. cpcompose reads the
plan's entries under `layers.*.` and applies them with torch's own styles (`parallelize_module`), as the
trainer's own Llama does, instead of transformers' `apply_tensor_parallelism`, because transformers' styles
do not compose with FSDP2 here: they replace each module's `forward`, and `replicated_with_grad_allreduce`
sums a gradient with a bare `dist.all_reduce` from a post-accumulate hook on the parameter, which under FSDP2
is the unsharded parameter FSDP swaps in for each forward (its gradient a DTensor the hook cannot reduce) and
a collective outside cpcompose's comm with its timeouts and one order. torch's styles are DTensor's: their
reductions are part of autograd, and FSDP2 shards their DTensor parameters over dp_shard x cp (a 2-D mesh
with the tp axis).

The plan's words, in torch's styles:

* `colwise` -> `ColwiseParallel()`: the weight's rows (output features: a projection's heads, a feed-forward's
  columns) and the bias split; the input replicated, the output this rank's columns, as a plain tensor. The
  attention sees plain q, k, v with this rank's heads, so CP attention runs on them unchanged (its exchange
  over the cp mesh, the heads local to the tp rank).
* `rowwise` -> `RowwiseParallel()`: the weight's columns split, the partial outputs summed over tp (an
  all-reduce), the bias replicated.
* `replicated_with_grad_allreduce` on a per-head norm (Qwen3's, Gemma 3's `q_norm` / `k_norm`, normalizing
  each head over `head_dim`) -> `PerHeadNorm`: its weight replicated, its rows (this rank's heads) marked as
  this rank's shard, so autograd sums the weight's gradient over the tp ranks.

A family without a plan (or one with entries outside its layers only) gets the trainer's own: Llama's
(`TRAINER_PLAN`), where its layers have those modules. Outside the layers everything stays replicated: the
embedding, the final norm and the output layer (the fused loss needs every logit of a token on one rank; see
`training/families/hf/tensor_parallel.py`). An attention that reshapes to a fixed head count instead of `-1`
fails its first forward with a shape error, never silently.

`tensor_parallel_plan` refuses, by name and before any rank starts, what cannot be split exactly: head or
kv-head counts (or a split width) `tp` does not divide; a layer's part with no tensor-parallel form (a Gated
DeltaNet, a Mamba mixer, a convolution: any part whose matrices the plan leaves whole); experts (expert
parallelism splits those); a norm over a projection's whole width (OLMo 2's `q_norm`: every head's values in
one statistic); a style this mapping does not apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from cpcompose.parallel.parallelize import parallelize_module

__all__ = ["PerHeadNorm", "TRAINER_PLAN", "TensorParallelPlan", "apply_tensor_parallel", "tensor_parallel_plan"]

COLWISE, ROWWISE, PER_HEAD = "colwise", "rowwise", "replicated_with_grad_allreduce"
STYLES = (COLWISE, ROWWISE, PER_HEAD)
"""The plan's words this module applies (transformers' names)."""

TRAINER_PLAN: Mapping[str, str] = MappingProxyType({
    "self_attn.q_proj": COLWISE, "self_attn.k_proj": COLWISE, "self_attn.v_proj": COLWISE,
    "self_attn.o_proj": ROWWISE,
    "mlp.gate_proj": COLWISE, "mlp.up_proj": COLWISE, "mlp.down_proj": ROWWISE,
})
"""The trainer's own plan, for a family that declares none: Llama's layer (heads and feed-forward columns split,
no sequence parallelism), applied to the modules a layer has."""


class PerHeadNorm(SequenceParallel):
    """A norm over each head's `head_dim` (`q_norm`, `k_norm`) inside a head-split attention.

    Each tp rank normalizes its own heads' rows, with the same weight: the weight is a replicated DTensor and
    the input is marked sharded on dim 0 (any dim but the normalized last one would do: the rows are this
    rank's), so autograd makes the weight's gradient a partial sum over the tp ranks. FSDP2 sums it when it
    reduces; without FSDP a hook on the parameter does (`_replicated_gradient`), so clipping and the optimizer
    see one replicated gradient.
    """

    def __init__(self) -> None:
        super().__init__(sequence_dim=0, use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_pre_hook(_hook_replicated_gradients)
        return module


def _hook_replicated_gradients(module: nn.Module, args: Any) -> None:
    """Before each forward: the parameters the module holds now (its own, or FSDP's gathered ones) reduce a
    partial gradient to a replicated one as it arrives (once per parameter object)."""
    for param in module.parameters(recurse=False):
        if isinstance(param, DTensor) and param.requires_grad and not getattr(param, "_cpcompose_tp_hooked", False):
            param.register_hook(_replicated_gradient)
            param._cpcompose_tp_hooked = True  # type: ignore[attr-defined]


def _replicated_gradient(grad: Tensor) -> Tensor:
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)
    return grad


@dataclass(frozen=True)
class TensorParallelPlan:
    """Which module of each decoder layer is split how (layer-relative names -> the plan's words)."""

    styles: Mapping[str, str]
    source: str
    """Whose plan: "the family's" (transformers' `base_model_tp_plan`) or "the trainer's own"."""

    def torch_styles(self, layer: nn.Module) -> dict[str, ParallelStyle]:
        """`layer`'s entries as torch styles (the modules it has)."""
        make = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel, PER_HEAD: PerHeadNorm}
        return {name: make[style]() for name, style in self.styles.items() if _submodule(layer, name) is not None}


def family_plan(model: nn.Module) -> dict[str, str]:
    """The family's plan for one decoder layer: the base model's `_tp_plan` (or the config's
    `base_model_tp_plan`) entries under `layers.*.`, without that prefix; {} when it has none."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    plan = getattr(base, "_tp_plan", None) or getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    return {key[len("layers.*."):]: style for key, style in (plan or {}).items() if key.startswith("layers.*.")}


def tensor_parallel_plan(model: nn.Module, layers: Sequence[nn.Module], tp: int, *,
                         prefix: str = "model.layers") -> TensorParallelPlan:
    """The plan `model`'s decoder `layers` are split by over `tp` ranks, every layer checked against it.

    Args:
        model: the transformers causal LM (on the meta device is enough).
        layers: its decoder layers.
        tp: the tensor-parallel degree.
        prefix: the layers' path, for the messages.

    Raises:
        ValueError: every reason found (joined by "; "), each naming the module, its class and the count or
            part that cannot be split.
    """
    styles = family_plan(model)
    source = "the family's"
    if not styles:
        styles, source = dict(TRAINER_PLAN), "the trainer's own"
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    reasons: list[str] = []
    for key in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(text, key, None)
        if isinstance(count, int) and count % tp:
            what = "attention heads" if key == "num_attention_heads" else "kv heads"
            reasons.append(f"{tp} does not divide the model's {count} {what} ({key}): each tensor-parallel rank "
                           "holds an equal share of the heads")
    seen: set[str] = set()
    for i, layer in enumerate(layers):  # each reason once, at the first layer it is found in
        for found in _layer_reasons(layer, styles, tp, f"{prefix}.{i}", source):
            if (key := found.replace(f"{prefix}.{i}.", f"{prefix}.*.")) not in seen:
                seen.add(key)
                reasons.append(found)
    if reasons:
        raise ValueError("; ".join(reasons))
    return TensorParallelPlan(MappingProxyType(styles), source)


def _layer_reasons(layer: nn.Module, styles: Mapping[str, str], tp: int, where: str, source: str) -> list[str]:
    """Why `layer` cannot be split by `styles` (empty: it can). Each part (child) of the layer is either split
    (some module in it is colwise or rowwise) and then every module in it holding parameters must be in the
    plan, or replicated (it sees the replicated residual stream) and then it may hold vectors only (a norm)."""
    reasons: list[str] = []
    for child_name, child in layer.named_children():
        owners = [(f"{child_name}.{n}" if n else child_name, m) for n, m in child.named_modules()
                  if next(m.parameters(recurse=False), None) is not None]
        if not owners:
            continue
        part = f"{type(child).__name__} ({where}.{child_name})"
        split = [n for n, _ in owners if styles.get(n) in (COLWISE, ROWWISE)]
        if split and any(_is_experts(m, styles.get(n)) for n, m in owners):  # a MoE block: its experts say it all
            reasons.append(f"{part} {_no_form(child, owners, styles)}")
            continue
        if not split:
            if all(p.dim() <= 1 for _, m in owners for p in m.parameters(recurse=False)):
                continue  # a norm of the residual stream: replicated
            reasons.append(f"{part} {_no_form(child, owners, styles)}")
            continue
        for name, module in owners:
            style = styles.get(name)
            at = f"{type(module).__name__} ({where}.{name})"
            if style is None:
                reasons.append(f"{at} {_unsplit(module, child)}, inside {part}, whose heads or columns {source} "
                               "plan splits")
            elif style not in STYLES:
                reasons.append(f"{at}: {source} plan's style {style!r} is not one the trainer applies "
                               f"({', '.join(STYLES)}; a gathered or packed projection would run every head on "
                               "every rank)")
            elif style == PER_HEAD:
                reasons.extend(f"{at} {r}" for r in _per_head_reasons(module, child))
            else:
                reasons.extend(f"{at} {r}" for r in _linear_reasons(module, style, tp))
    return reasons


def _no_form(child: nn.Module, owners: list[tuple[str, nn.Module]], styles: Mapping[str, str]) -> str:
    """Why a part that no colwise or rowwise entry splits cannot stay replicated either."""
    if any(_is_experts(m, styles.get(n)) for n, m in owners) or _is_experts(child, None):
        return "holds experts, which expert parallelism (parallelism.ep) splits, not tensor parallelism"
    planned = any(n in styles for n, _ in owners)
    for name, module in owners:
        if planned and styles.get(name) is None and _is_wide_norm(module, child):
            return f"has a norm ({name}) that {_unsplit(module, child)}"
    for name, module in owners:
        if (style := styles.get(name)) is not None and style not in STYLES:
            return (f"has no tensor-parallel form here: the family's plan splits {name} as {style!r}, a style the "
                    f"trainer does not apply (it applies {', '.join(STYLES)}; a gathered or packed projection runs "
                    "every head on every rank)")
    return ("has no tensor-parallel form: the plan splits none of its matrices (a Gated DeltaNet, a Mamba mixer, a "
            "convolution, latent attention, ...), and they cannot run whole on a share of the heads")


def _is_wide_norm(module: nn.Module, attention: nn.Module) -> bool:
    """A norm (vectors only, a class named ...Norm) wider than one head of `attention` (which has `head_dim`)."""
    head_dim = getattr(attention, "head_dim", None)
    params = list(module.parameters(recurse=False))
    return (bool(head_dim) and "norm" in type(module).__name__.lower() and all(p.dim() == 1 for p in params)
            and any(p.shape[0] != head_dim for p in params))


def _unsplit(module: nn.Module, attention: nn.Module) -> str:
    """What a module the plan leaves whole inside a split part is."""
    params = dict(module.named_parameters(recurse=False))
    if _is_wide_norm(module, attention):
        widths = ", ".join(str(p.shape[0]) for p in params.values())
        return (f"normalizes over the whole projected width ({widths}: every head's values in one statistic), which "
                f"tensor parallelism splits between ranks (a per-head norm over head_dim "
                f"{getattr(attention, 'head_dim')} would not be)")
    return "holds " + ", ".join(f"{n} {tuple(p.shape)}" for n, p in params.items()) + " the plan leaves whole"


def _is_experts(module: nn.Module, style: str | None) -> bool:
    return (style is not None and style.startswith("moe_")) or type(module).__name__.endswith(("Experts", "MoE",
                                                                                                 "MoeBlock"))


def _per_head_reasons(module: nn.Module, attention: nn.Module) -> list[str]:
    """A `replicated_with_grad_allreduce` module must be a norm over one head (its vectors `head_dim` wide)."""
    head_dim = getattr(attention, "head_dim", None)
    params = list(module.parameters(recurse=False))
    if head_dim and all(p.dim() == 1 and p.shape[0] == head_dim for p in params):
        return []
    widths = ", ".join(str(tuple(p.shape)) for p in params)
    return [f"normalizes over {widths}, not one head's head_dim ({head_dim}): a norm over the whole projected "
            "width mixes heads that tensor parallelism splits between ranks"]


def _linear_reasons(module: nn.Module, style: str, tp: int) -> list[str]:
    if not isinstance(module, nn.Linear):
        return [f"is split {style} by the plan but is not an nn.Linear, which torch's {style} style splits"]
    width, what = (module.out_features, "output") if style == COLWISE else (module.in_features, "input")
    if width % tp:
        return [f"has {width} {what} features, which {tp} tensor-parallel ranks do not split evenly "
                "(choose a parallelism.tp that divides it)"]
    return []


def _submodule(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def apply_tensor_parallel(layers: Sequence[nn.Module], plan: TensorParallelPlan, mesh: DeviceMesh) -> None:
    """Split each of `layers` over the 1-D tp `mesh` as `plan` says, in place (before FSDP, on the meta device or
    not: torch's styles distribute the parameters as they are)."""
    for layer in layers:
        styles = plan.torch_styles(layer)
        if styles:
            parallelize_module(layer, mesh, styles, src_data_rank=None)  # no data yet: the weights are read after
