"""transformers' own experts modules, read by `read_experts`, give their own forward: one reading per layout.

Three layouts, each a family's experts module built alone from a tiny config with its own (random) weights:
Qwen3-MoE (stacked `(experts, out, in)`, `[gate; up]`, SiLU), gpt-oss (`(experts, in, out)`, per-expert
biases, gate and up interleaved, clamped SwiGLU with its alpha; the limit lowered so the clamps act) and
Nemotron-H (ungated: `up_proj` alone, squared ReLU). In float64 against the module's eager forward (its loop
over experts), outputs and gradients of the input, the routing weights and every parameter; in float32 the
grouped GEMM against the module's own `grouped_mm` path. Tolerances derived (`tests/support/tolerance.py`):
`terms` = hidden + intermediate (the two chained products) + the routed pairs (what a weight gradient sums).
"""

from __future__ import annotations

import pytest
import torch
import transformers as hf
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from cpcompose.integrations.transformers.experts import read_experts
from tests.support.tolerance import tolerance

HIDDEN, INTER, EXPERTS, TOKENS, TOP_K = 16, 8, 4, 6, 2

FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeExperts(hf.Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K)),
    "gpt_oss": lambda: GptOssExperts(hf.GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        swiglu_limit=1.0)),
    "nemotron_h": lambda: NemotronHExperts(hf.NemotronHConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K)),
}
TERMS = HIDDEN + INTER + TOKENS * TOP_K


def _module(name: str, dtype: torch.dtype, implementation: str) -> torch.nn.Module:
    module = FAMILIES[name]()
    module.config._experts_implementation = implementation
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return module.to(dtype)


def _routing(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden rows, top-k choices (expert 3 chosen by none, expert 1 by one token), weights, a cotangent."""
    g = torch.Generator().manual_seed(1)
    index = torch.tensor([[0, 2], [2, 0], [1, 2], [0, 2], [2, 0], [0, 2]])
    weights = torch.rand(TOKENS, TOP_K, generator=g, dtype=torch.float64).to(dtype)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    return hidden, index, weights, torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64).to(dtype)


def _forward_backward(module: torch.nn.Module, forward, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    hidden, index, weights, cotangent = _routing(dtype)
    hidden.requires_grad_()
    weights.requires_grad_()
    module.zero_grad(set_to_none=True)
    out = forward(hidden, index, weights)
    out.backward(cotangent)
    grads = {f"d{n}": p.grad for n, p in module.named_parameters()}
    return {"out": out.detach(), "dhidden": hidden.grad, "dweights": weights.grad, **grads}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_layout_read_gives_the_modules_own_forward(name: str) -> None:
    module = _module(name, torch.float64, "eager")
    want = _forward_backward(module, module, torch.float64)
    got = _forward_backward(module, read_experts(module), torch.float64)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **tolerance(want[key], terms=TERMS), msg=key)
    assert not got[next(k for k in got if k.startswith("ddown"))][3].any()  # the expert no token chose


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_the_grouped_gemm_gives_transformers_grouped_mm(name: str) -> None:
    module = _module(name, torch.float32, "grouped_mm")
    want = _forward_backward(module, module, torch.float32)
    experts = read_experts(module)
    got = _forward_backward(module, lambda *a: experts(*a, kernel="grouped_mm"), torch.float32)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **tolerance(want[key], terms=TERMS), msg=key)


def test_a_choice_past_the_last_expert_routes_nowhere() -> None:
    """Zaya's skip expert (index = experts), which transformers' eager loop skips too."""
    module = _module("qwen3_moe", torch.float64, "eager")
    hidden, index, weights, _ = _routing(torch.float64)
    index = index.clone()
    index[1, 0] = index[4, 1] = EXPERTS
    want = module(hidden, index, weights)
    torch.testing.assert_close(read_experts(module)(hidden, index, weights), want, **tolerance(want, terms=TERMS))


def test_an_undeclared_layout_is_refused_by_name() -> None:
    config = hf.Llama4TextConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=2)
    with pytest.raises(ValueError, match=r"Llama4TextExperts: .*\(Llama 4's experts are \(experts, hidden"):
        read_experts(Llama4TextExperts(config))
