"""transformers' experts modules read as `cpcompose.experts` weights: one reading per layout, not per family.

transformers 5 decorates the experts class of nearly every mixture-of-experts family with
`@use_experts_implementation(...)`, and the decorator writes the layout onto each instance: `is_transposed`
(weights `(experts, in, out)`, gpt-oss), `has_bias` (`gate_up_proj_bias`, `down_proj_bias`), `has_gate`
(`gate_up_proj`, or `up_proj` alone for ungated experts: Nemotron-H's squared ReLU), `is_concatenated`
(gate and up as `[gate; up]` or interleaved, gpt-oss) and `has_post_expert_norm` (`post_expert_norm`, a row-wise
norm after the second projection). The activation between the projections is the instance's own
`_apply_gate(gate_up)` (which splits gate and up as the weights store them: SwiGLU, gpt-oss's clamped one,
GLM-5's clamped SiLU) or `act_fn` for ungated experts, so every family that declares its layout reads the same
way. An experts class that declares none (Llama 4, DBRX, LongCat-Flash, Step-3.7, JetMoE) is refused by name
with what it stores instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from cpcompose.experts import ExpertKernel, ExpertWeights, routed_experts

__all__ = ["UNDECLARED_EXPERTS", "TransformersExperts", "read_experts"]

UNDECLARED_EXPERTS: dict[str, str] = {
    # the experts classes of causal LMs that declare no layout: class name -> what they store instead
    "Llama4TextExperts": "Llama 4's experts are (experts, hidden, 2 x intermediate) and run densely, every token "
                         "through every expert with its router score multiplied into the input",
    "DbrxExperts": "DBRX stores w1, v1 and w2 flattened to (experts x ffn, hidden), gate and up apart",
    "LongcatFlashExperts": "LongCat-Flash routes to zero-compute (identity) experts beside its real ones",
    "Step3p7Experts": "Step-3.7's experts declare no layout (stacked like Qwen3-MoE, with its own clamped SwiGLU)",
    "JetMoeMoA": "JetMoE's mixture of attention heads is experts inside attention, not an MLP",
    "JetMoeMoE": "JetMoE keeps its experts in JetMoeParallelExperts (input_linear, output_linear)",
}


@dataclass(frozen=True)
class TransformersExperts:
    """One transformers experts module as `routed_experts` takes it: its own parameters, no copy."""

    weights: ExpertWeights
    activation: Callable[[Tensor], Tensor]
    """The first projection's rows to the second's: the module's `_apply_gate` (gated) or `act_fn`."""
    post: Callable[[Tensor], Tensor] | None
    """The module's `post_expert_norm`, or None."""

    def __call__(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *,
                 kernel: ExpertKernel = "auto") -> Tensor:
        """The module's forward `(hidden, top_k_index, top_k_weights) -> (tokens, hidden)`, by `routed_experts`."""
        return routed_experts(hidden, top_k_index, top_k_weights, self.weights, activation=self.activation,
                              post=self.post, kernel=kernel)


def read_experts(module: nn.Module) -> TransformersExperts:
    """The experts `module` (a transformers experts class) in `cpcompose.experts`' terms.

    Raises:
        ValueError: a class that declares no layout (named, with what it stores), or one whose flags name
            parameters it lacks.
    """
    name = type(module).__name__
    if not hasattr(module, "is_transposed"):
        why = UNDECLARED_EXPERTS.get(name,
                                     "its class is not decorated with transformers' @use_experts_implementation")
        raise ValueError(f"{name}: its layout is not declared, so cpcompose cannot read its experts ({why})")
    gated = bool(module.has_gate)
    first = "gate_up_proj" if gated else "up_proj"
    biased = bool(module.has_bias)
    try:
        weights = ExpertWeights(
            gate_up=getattr(module, first), down=module.down_proj, transposed=bool(module.is_transposed),
            gate_up_bias=getattr(module, f"{first}_bias") if biased else None,
            down_bias=module.down_proj_bias if biased else None,
        )
    except AttributeError as e:
        raise ValueError(f"{name} declares has_gate={gated}, has_bias={biased} but lacks a parameter: {e}") from e
    activation = module._apply_gate if gated else module.act_fn
    post = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
    return TransformersExperts(weights, activation, post)
