"""One layer's routed experts, held in the layout the model stores them: two stacked projections, no copy.

Every mixture-of-experts family transformers 5 ships stores its experts in one of two stackings
(`docs/design/experts.md` lists them family by family): `(experts, out, in)`, `nn.Linear`'s own layout,
applied as `rows @ W[e].T` (Qwen3-MoE, Mixtral, DeepSeek-V3 and nearly all others), or `(experts, in, out)`,
applied as `rows @ W[e]` (gpt-oss, Llama 4, Aria). Per-expert biases come with the second (gpt-oss). How the
first projection's columns split into gate and up, and the activation between the projections, are the
activation's business (`grouped_experts`' `activation`), so one record serves every family of a stacking.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["ExpertWeights"]


@dataclass(frozen=True)
class ExpertWeights:
    """Two stacked projections, expert `e` in row `e` of each tensor.

    `gate_up`: the first projection, `(experts, out, hidden)` or, with `transposed`, `(experts, hidden, out)`;
    `out` is gate and up together for gated experts, the intermediate size otherwise.
    `down`: the second, `(experts, hidden, intermediate)` or, with `transposed`, `(experts, intermediate, hidden)`.
    `gate_up_bias` `(experts, out)` and `down_bias` `(experts, hidden)`: per-expert biases, or None.
    """

    gate_up: Tensor
    down: Tensor
    transposed: bool = False
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None

    def __post_init__(self) -> None:
        if self.gate_up.dim() != 3 or self.down.dim() != 3 or self.gate_up.shape[0] != self.down.shape[0]:
            raise ValueError(f"expert weights are two stacks (experts, ., .) of the same experts: gate_up "
                             f"{tuple(self.gate_up.shape)}, down {tuple(self.down.shape)}")
        if self.hidden != self.down.shape[-1 if self.transposed else -2]:
            raise ValueError(f"gate_up {tuple(self.gate_up.shape)} reads hidden size {self.hidden}, down "
                             f"{tuple(self.down.shape)} writes another (transposed={self.transposed})")
        for name, bias, size in (("gate_up_bias", self.gate_up_bias, self.out),
                                 ("down_bias", self.down_bias, self.hidden)):
            if bias is not None and tuple(bias.shape) != (self.num_experts, size):
                raise ValueError(f"{name} is {tuple(bias.shape)}, expected {(self.num_experts, size)}")

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden(self) -> int:
        """The size of the rows going in and coming out."""
        return self.gate_up.shape[-2 if self.transposed else -1]

    @property
    def out(self) -> int:
        """The first projection's width (gate and up together for gated experts)."""
        return self.gate_up.shape[-1 if self.transposed else -2]

    @property
    def intermediate(self) -> int:
        """The second projection's input width: what the activation must return."""
        return self.down.shape[-2 if self.transposed else -1]
