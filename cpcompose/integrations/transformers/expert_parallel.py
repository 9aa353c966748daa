"""transformers' experts modules in their expert-parallel (EP) form: each rank keeps a block of the experts.

A mixture-of-experts block in transformers 5 calls its experts module as `experts(hidden_states, top_k_index,
top_k_weights)` on the flattened tokens (`(tokens, hidden)`, `(tokens, k)`, `(tokens, k)`) after its router has
chosen. `ExpertParallelExperts` takes that module's place on an EP group of `ep` ranks: it holds only this rank's
contiguous block of `E / ep` experts (the stacked weights sliced along the expert dimension, under the module's
own parameter names, so `mlp.experts.gate_up_proj` is rows `[r * E/ep, (r + 1) * E/ep)` of the full tensor),
and its forward is `cpcompose.experts.parallel_routed_experts`: every routed choice to its expert's rank, the
local experts' grouped compute, the results home, weighed and summed as transformers does. The router, shared
experts and everything dense stay on the rank's own tokens (its batch rows, its CP shard, or both), so the
model's code is untouched: the block calls the new module as it called the old one.

The layout (stacked or transposed, biases, gated or not, the post-expert norm) and the activation are the
module's own, read by `read_experts`; a class that declares no layout is refused by name. The experts' weights
are copied from the full module's block; on a model built on the meta device nothing is copied, and each rank
reads its block from the checkpoint (`expert_blocks` gives `WeightPlan.of_expert_blocks` the rows).

Gradients: a local expert's gradient already sums the contributions of every rank's tokens (dispatch's
backward brings them), so the experts' parameters must not be summed over the EP group again; the dense ones
are, as under CP alone. `expert_parameter_names` says which are which.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter, CPGroup
from cpcompose.experts import ExpertKernel, ExpertWeights, parallel_routed_experts
from cpcompose.integrations.transformers.experts import UNDECLARED_EXPERTS, read_experts

__all__ = ["ExpertParallelExperts", "apply_expert_parallel", "expert_blocks", "expert_parameter_names",
           "experts_modules"]


class ExpertParallelExperts(nn.Module):
    """One transformers experts module's expert-parallel form: this rank's block of experts, the same call.

    Args:
        experts: the full experts module (a class decorated with `@use_experts_implementation`); it is left
            unchanged, its weights copied.
        group: the EP group (a 1-D mesh, the expert mesh's `"ep"` axis, or its `CPGroup`).
        kernel: as `grouped_experts` takes it ("auto": the grouped GEMM where torch has one for the dtype).
        meter: counts the bytes this rank sends.

    Raises:
        ValueError: a layout `read_experts` refuses, or an expert count the group's size does not divide.
    """

    def __init__(self, experts: nn.Module, group: DeviceMesh | CPGroup, *, kernel: ExpertKernel = "auto",
                 meter: CommMeter | None = None) -> None:
        super().__init__()
        read = read_experts(experts)
        self.group = group if isinstance(group, CPGroup) else CPGroup.from_mesh(group)
        self.num_experts = read.weights.num_experts
        if self.num_experts % self.group.world:
            raise ValueError(f"{type(experts).__name__}: {self.num_experts} experts do not split into equal blocks "
                             f"over {self.group.world} EP ranks (parallelism.ep must divide the expert count)")
        self.num_local_experts = self.num_experts // self.group.world
        self.first_expert = self.group.rank * self.num_local_experts
        self.kernel, self.meter = kernel, meter
        self.transposed = read.weights.transposed
        self.layout_of = type(experts).__name__
        gated = bool(experts.has_gate)
        first = "gate_up_proj" if gated else "up_proj"
        self._names = (first, "down_proj", f"{first}_bias", "down_proj_bias")
        block = slice(self.first_expert, self.first_expert + self.num_local_experts)
        w = read.weights
        for name, full in zip(self._names, (w.gate_up, w.down, w.gate_up_bias, w.down_bias)):
            if full is not None:
                self.register_parameter(name, nn.Parameter(full.detach()[block].clone(),
                                                           requires_grad=full.requires_grad))
        if read.post is not None:
            self.post_expert_norm = read.post  # a dense module (same on every rank), its own parameters
        # The activation is the module's own `_apply_gate` (or `act_fn`): bound to a copy that keeps the
        # module's settings (activation, clamps, config) but not its full stacked weights.
        layout = copy.copy(experts)
        layout._parameters = {}
        layout._modules = dict(experts._modules)
        layout._buffers = dict(experts._buffers)
        self._activation: Callable[[Tensor], Tensor] = layout._apply_gate if gated else layout.act_fn

    def local_weights(self) -> ExpertWeights:
        """This rank's block as `grouped_experts` takes it (its own parameters, no copy)."""
        first, down, first_bias, down_bias = (getattr(self, n, None) for n in self._names)
        return ExpertWeights(first, down, transposed=self.transposed, gate_up_bias=first_bias, down_bias=down_bias)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """transformers' experts call: `(tokens, hidden)`, `(tokens, k)` indices and weights -> `(tokens, hidden)`."""
        return parallel_routed_experts(
            hidden_states, top_k_index, top_k_weights, self.local_weights(), num_experts=self.num_experts,
            group=self.group, activation=self._activation, post=getattr(self, "post_expert_norm", None),
            kernel=self.kernel, meter=self.meter)

    def extra_repr(self) -> str:
        last = self.first_expert + self.num_local_experts - 1
        return (f"{self.layout_of}, experts {self.first_expert}..{last} of {self.num_experts} on EP rank "
                f"{self.group.rank} of {self.group.world}, kernel={self.kernel!r}")


def _is_experts_module(module: nn.Module) -> bool:
    """A transformers experts module: decorated (the decorator writes its layout flags on each instance), or a
    class known to declare none."""
    return (hasattr(module, "is_transposed") and hasattr(module, "has_gate")) or \
        type(module).__name__ in UNDECLARED_EXPERTS


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every transformers experts module of `model` (declared layout or not), in
    `named_modules` order: what `apply_expert_parallel` swaps (or refuses by name)."""
    return [(name, module) for name, module in model.named_modules() if _is_experts_module(module)]


def apply_expert_parallel(model: nn.Module, group: DeviceMesh | CPGroup, *, kernel: ExpertKernel = "auto",
                          meter: CommMeter | None = None) -> list[str]:
    """Swap every experts module of a built transformers model for its `ExpertParallelExperts` on `group`.

    Every rank calls it on the same model (same weights: each keeps its own block of every layer's experts).
    Nothing is swapped unless every experts module can be: a refused layout leaves the model as it was.

    Args:
        model: a transformers model (any module holding transformers experts modules).
        group: the EP group (the expert mesh's `"ep"` axis, or its `CPGroup`).
        kernel, meter: as `ExpertParallelExperts` takes them.

    Returns:
        The qualified names of the swapped modules, in `named_modules` order.

    Raises:
        ValueError: an experts class whose layout is not declared (named, with what it stores), or an expert
            count the group's size does not divide.
    """
    found = experts_modules(model)
    swapped = {name: ExpertParallelExperts(module, group, kernel=kernel, meter=meter) for name, module in found}
    for name, ep_module in swapped.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, ep_module)
    return list(swapped)


def expert_blocks(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(first expert, count) of every `ExpertParallelExperts` parameter of `model` held in blocks (qualified names):
    rows `[first, first + count)` of the stored stacked tensor, what this rank loads (`WeightPlan.of_expert_blocks`)."""
    return {f"{prefix}.{n}": (module.first_expert, module.num_local_experts)
            for prefix, module in model.named_modules() if isinstance(module, ExpertParallelExperts)
            for n in module._names if getattr(module, n, None) is not None}


def expert_parameter_names(model: nn.Module) -> set[str]:
    """The parameters of `model`'s `ExpertParallelExperts` blocks (qualified names): each rank's own experts,
    whose gradients already hold every rank's tokens and must not be summed over the EP group; the post-expert
    norm, a dense module, is not among them."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, ExpertParallelExperts):
            names.update(f"{prefix}.{n}" for n in module._names if getattr(module, n, None) is not None)
    return names
