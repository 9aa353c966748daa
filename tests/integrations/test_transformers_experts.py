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

import inspect

import pytest
import torch
import transformers as hf
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from cpcompose.comm import CPGroup
from cpcompose.integrations.transformers.expert_parallel import apply_expert_parallel, experts_modules
from cpcompose.integrations.transformers.experts import UNDECLARED_EXPERTS, read_experts
from tests.support import moe_families
from tests.support.hybrid_cases import one_thread
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


@one_thread()  # tiny eager loops: two threads on two shared cores spin against each other (10 ms an index_add_)
def test_every_moe_causal_lm_is_read_or_refused_by_name() -> None:
    """The survey (docs/design/experts.md): every causal LM in transformers' auto mapping whose modeling file names
    experts, built tiny (`tests/support/moe_families.py`), is either read by EP's adapter (each experts module is
    called with `(hidden, top_k_index, top_k_weights)` and `read_experts` gives its own eager forward in float64
    on a few tokens, its weights and biases random) or refused by `apply_expert_parallel` with the class named,
    before any communication; a family with no experts module in its tiny build is refused by the trainer
    ("has no experts module"), and the families that cannot be built tiny are exactly `NOT_BUILT`.
    `terms` = hidden + intermediate + the routed pairs, as above."""
    unbuilt, read, refused, none = {}, set(), set(), set()
    g = torch.Generator().manual_seed(3)
    for model_type in moe_families.moe_model_types():
        model = moe_families.build_tiny(model_type)
        if isinstance(model, str):
            unbuilt[model_type] = model
            continue
        found = experts_modules(model)
        if not found:
            none.add(model_type)
        if any(type(m).__name__ in UNDECLARED_EXPERTS for _, m in found):
            first = next(type(m).__name__ for _, m in found if type(m).__name__ in UNDECLARED_EXPERTS)
            with pytest.raises(ValueError, match=rf"^{first}: its layout is not declared"):
                apply_expert_parallel(model, CPGroup(group=None, rank=0, world=2))  # type: ignore[arg-type]
            refused.add(model_type)
            continue
        for name, module in found:
            assert len(inspect.signature(module.forward).parameters) == 3, (model_type, name)  # EP's call
            module.to_empty(device="cpu")
            with torch.no_grad():
                for p in module.parameters():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
            adapter = read_experts(module)
            experts, hidden = adapter.weights.num_experts, module.config.hidden_size
            index = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(TOKENS)])
            weights = torch.rand(TOKENS, TOP_K, generator=g, dtype=torch.float64)
            rows = torch.randn(TOKENS, hidden, generator=g, dtype=torch.float64)
            want = module(rows, index, weights)
            terms = hidden + max(adapter.weights.down.shape[1:]) + TOKENS * TOP_K
            dtype = torch.float32 if model_type in moe_families.FLOAT32_SUM else None
            torch.testing.assert_close(adapter(rows, index, weights, kernel="loop"), want,
                                       **tolerance(want, terms=terms, dtype=dtype),
                                       msg=lambda m: f"{model_type} {name}: {m}")
        read.add(model_type)
    assert set(unbuilt) == set(moe_families.NOT_BUILT), unbuilt
    assert refused == {"dbrx", "jetmoe", "llama4_text", "longcat_flash"}, refused
    assert none == set(moe_families.NO_EXPERTS), none
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_next", "qwen2_moe", "olmoe", "sarvam_mla"} <= read, read
    assert len(read) >= 49, sorted(read)
