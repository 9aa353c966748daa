"""`causal_lm_head`: every family it knows gives the model's own loss, with its logits never whole.

For each `HEADS` entry, a tiny random float64 model (experts computed eagerly: the grouped kernel
takes no float64): the fused loss from the body's hidden states (`CausalLMHead.loss`, which runs
`cp_linear_cross_entropy` in chunks of 5 tokens) against `cp_cross_entropy` of the model's own
logits, on a one-rank mesh; loss and every parameter gradient to `TOL` (derived; float64, the same
arithmetic in another order). Families that change their logits (Gemma 2/3, RecurrentGemma and xLSTM
softcap, Cohere, Granite, GraniteMoeHybrid and Falcon-H1 scale) get values that make the change matter,
and dropping it must change the loss. The hybrids run on their tiny configs from
tests/support/hybrid_families.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as hf

import cpcompose.integrations.transformers as cphf
from cpcompose import cp_cross_entropy
from tests.support.hybrid_families import HYBRIDS
from tests.support.tolerance import assert_close

# Derived (tests/support/tolerance.py), float64: the longest sum is the head's over tokens x vocabulary (64).
TOL = dict(terms=64 * 64)
TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=1)
_EXPERTS = dict(num_experts_per_tok=1, moe_intermediate_size=16)
_DSA = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=8, n_shared_experts=1, n_routed_experts=2, n_group=1, topk_group=1, index_topk=6,
            index_head_dim=8, index_n_heads=2, **_EXPERTS)  # indexer-selected attention (DSA)
EXTRA = {
    "gemma": dict(head_dim=8),
    "gemma2": dict(head_dim=8, final_logit_softcapping=0.05),  # logits of ~0.4: the cap bends them
    "gemma3_text": dict(head_dim=8, final_logit_softcapping=0.05),
    "cohere": dict(logit_scale=3.0),
    "cohere2": dict(logit_scale=3.0),
    "granite": dict(logits_scaling=0.25),
    "granitemoe": dict(logits_scaling=0.25, num_local_experts=2, num_experts_per_tok=1),
    "mixtral": dict(num_local_experts=2, num_experts_per_tok=1),
    "qwen2_moe": dict(num_experts=2, shared_expert_intermediate_size=16, **_EXPERTS),
    "qwen3": dict(head_dim=8),
    "qwen3_moe": dict(num_experts=2, **_EXPERTS),
    "qwen3_next": dict(head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2,
                       shared_expert_intermediate_size=16, **_EXPERTS),
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                        v_head_dim=6, first_k_dense_replace=1, n_routed_experts=2, n_group=1, topk_group=1, **_EXPERTS),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    **{dsa: dict(_DSA, first_k_dense_replace=1) if dsa in ("deepseek_v32", "glm_moe_dsa") else _DSA
       for dsa in ("deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note_text")},
}
# The hybrids: their own tiny float64 configs (tests/support/hybrid_families.py), by model_type, with values
# that make a change of the logits matter.
HYBRID_TYPES = {HYBRIDS[name].config().model_type: name for name in HYBRIDS}
HYBRID_EXTRA = {
    "falcon_h1": dict(lm_head_multiplier=3.0),
    "granitemoehybrid": dict(logits_scaling=0.25),
    "recurrent_gemma": dict(logits_soft_cap=0.05),
    "xlstm": dict(output_logit_soft_cap=0.05),
}
FLOAT32_LOGITS = {"mamba", "falcon_mamba", "mamba2", "nemotron_h", "xlstm"}  # `lm_head(...).float()`
CHANGES_LOGITS = {"gemma2", "gemma3_text", "cohere", "cohere2", "granite", "granitemoe", *HYBRID_EXTRA}


def _model(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if model_type in HYBRID_TYPES:
        config = HYBRIDS[HYBRID_TYPES[model_type]].config()
        for key, value in HYBRID_EXTRA.get(model_type, {}).items():
            setattr(config, key, value)
    else:
        config = hf.AutoConfig.for_model(model_type, **{**TINY, **EXTRA.get(model_type, {})})
    return hf.AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager")


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def fused_against_logits(mesh, model_type: str) -> dict:
    model = _model(model_type)
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    labels[:, ::5] = -100
    want = cp_cross_entropy(model(input_ids=ids, use_cache=False).logits, labels, mesh=mesh)
    want.backward()
    want_grads = _grads(model)
    head = cphf.causal_lm_head(model)
    hidden = head.body(input_ids=ids, use_cache=False).last_hidden_state
    got = head.loss(hidden, labels, mesh=mesh, chunk_tokens=5)
    got.backward()
    plain = dataclasses.replace(head, softcap=None, scale=None).loss(hidden.detach(), labels, mesh=mesh)
    return {"want": want.detach(), "got": got.detach(), "want_grads": want_grads, "grads": _grads(model),
            "plain": plain.detach()}


@pytest.mark.parametrize("model_type", sorted(cphf.HEADS))
def test_fused_loss_equals_the_models_own(pools, model_type: str) -> None:
    (r,) = pools.get(1).run(fused_against_logits, model_type)
    # Families whose forward casts the logits to float32 (`.float()`) round them once: float32's epsilon.
    dtype = torch.float32 if model_type in FLOAT32_LOGITS else None
    assert_close(r["got"], r["want"].double(), **TOL, dtype=dtype)
    assert r["grads"].keys() == r["want_grads"].keys() and len(r["grads"]) > 10
    for name, grad in r["want_grads"].items():
        assert_close(r["grads"][name], grad, **TOL, dtype=dtype, msg=name)
    if model_type in CHANGES_LOGITS:  # the test would see a family whose change the head dropped
        assert abs(r["plain"] - r["want"]) > 1e-3


def test_bamba_with_a_z_loss_is_refused() -> None:
    """Bamba's own loss adds a z-loss when `z_loss_coefficient` is set, which the fused loss would leave out."""
    config = HYBRIDS["bamba"].config()
    config.z_loss_coefficient = 1e-4
    with pytest.raises(ValueError, match=r"z_loss_coefficient = 0.0001.*set it to 0"):
        cphf.causal_lm_head(hf.AutoModelForCausalLM.from_config(config))


def test_a_family_it_does_not_know_is_refused() -> None:
    config = hf.GPTNeoXConfig(**{k: v for k, v in TINY.items() if k != "num_key_value_heads"})
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM \(model_type 'gpt_neox'\).*cannot fuse its loss"):
        cphf.causal_lm_head(hf.AutoModelForCausalLM.from_config(config))
