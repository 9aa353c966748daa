"""Hugging Face causal LMs cut into pipeline stages (`cpcompose.integrations.transformers.pipeline`), in one process.

Every family the tests build (the attention families of `hf_cases.ARCHS`, every hybrid of `HYBRIDS`, the MoE
families the trainer's tests write) is cut into one stage per decoder layer; the stages chained by hand must give
the whole model's logits and every gradient. Float64, and no tolerance: a stage runs the family's own forward on
the same layers in the same order (the pass-throughs add no arithmetic), so the results are bitwise equal (a
family whose base forward does something between the layers, or whose head differs, misses by far more: measured
2.2 relative on LFM2 with its final norm missed, 1e-6 on Mamba2 without its float32 logits). The families that
cannot be cut are refused by name, the list asserted exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers as hf

from cpcompose.integrations.transformers.head import HEADS
from cpcompose.integrations.transformers.pipeline import (
    CUT_REFUSED,
    held_layers_only,
    pipeline_refusal,
    split_causal_lm,
    stages_without_token_mixing,
)
from tests.support import dsa_cases, hf_cases
from tests.support.hf_trainer import MOE_FAMILIES, _moe_config
from tests.support.hybrid_families import HYBRIDS

_MOE_COMMON = dict(vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=1)
_EAGER = {"gemma2", "gpt_oss"}  # transformers refuses sdpa for them (softcap, sinks)


def _families() -> dict[str, tuple]:
    """name -> (config maker, auto class, attention implementation or None)."""
    out: dict[str, tuple] = {}
    for name, make in hf_cases.ARCHS.items():
        if name not in hf_cases.MASKED_LM:
            out[name] = (make, hf.AutoModelForCausalLM, "eager" if name in _EAGER else "sdpa")
    for name, hybrid in HYBRIDS.items():
        impl = ("eager" if name in _EAGER else "sdpa") if hybrid.attention else None
        out[f"hybrid:{name}"] = (hybrid.config, hybrid.auto, impl)
    for name in MOE_FAMILIES:
        out[f"moe:{name}"] = (lambda name=name: _moe_config(name, _MOE_COMMON), hf.AutoModelForCausalLM,
                              "eager" if name in _EAGER else "sdpa")
    for name, make in dsa_cases.CONFIGS.items():
        if name not in dsa_cases.REFERENCE_IMPL:  # HunYuan V4: eager attention only, and no known head
            out[f"dsa:{name}"] = (make, hf.AutoModelForCausalLM, "sdpa")
    for name, make in _MORE.items():
        out[name] = (make, hf.AutoModelForCausalLM, "sdpa")
    return out


_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=1)
_MORE = {  # the families of head.HEADS no other list builds; factors away from 1 where the family has them
    "gemma": lambda: hf.GemmaConfig(**_SMALL, head_dim=8),
    "cohere": lambda: hf.CohereConfig(**_SMALL, logit_scale=0.5),
    "cohere2": lambda: hf.Cohere2Config(**_SMALL, logit_scale=0.5, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"]),
    "granite": lambda: hf.GraniteConfig(**_SMALL, embedding_multiplier=3.0, logits_scaling=2.0,
                                        residual_multiplier=0.5),
    "granitemoe": lambda: hf.GraniteMoeConfig(**_SMALL, embedding_multiplier=3.0, logits_scaling=2.0,
                                              num_local_experts=2, num_experts_per_tok=1),
    "qwen2_moe": lambda: hf.Qwen2MoeConfig(**_SMALL, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                                           shared_expert_intermediate_size=16),
}


FAMILIES = _families()
REFUSED = {  # the families (keys of FAMILIES) that cannot be cut, and what their refusal names
    "gpt_neox": "does not know what its forward does to the logits",
    "hybrid:zamba": "cannot be cut into pipeline stages: its hybrid layers share one attention block",
    "hybrid:zamba2": "cannot be cut into pipeline stages: its hybrid layers share attention blocks",
    "hybrid:qwen4_exp": "cannot be cut into pipeline stages: its layers pass hyper-connection streams",
    "hybrid:glm5_next": "its layers pass hyper-connection streams",
    "dsa:glm_moe_dsa": "its layers pass their indexer's top-k choice to the next",
    "dsa:glm_moe_dsa_ties": "its layers pass their indexer's top-k choice to the next",
}


def _build(name: str, *, untie: bool = True) -> torch.nn.Module:
    make, auto, impl = FAMILIES[name]
    config = make()
    text = config.get_text_config()
    if untie:  # tied embeddings are refused under pipelining (tested below)
        config.tie_word_embeddings = text.tie_word_embeddings = False
    config.output_router_logits = text.output_router_logits = False  # transformers' router loss: not cut (trainer)
    torch.manual_seed(0)
    extra = {} if impl is None else {"attn_implementation": impl}
    model = auto.from_config(config, dtype=torch.float64, experts_implementation="eager", **extra)
    return model.train()


def _layers(model: torch.nn.Module) -> int:
    base = getattr(model, model.base_model_prefix)
    return len(getattr(base, "layers", None) or base.blocks)


def _has_layers(model: torch.nn.Module) -> bool:
    base = getattr(model, model.base_model_prefix or "", None)
    return any(isinstance(getattr(base, n, None), torch.nn.ModuleList) for n in ("layers", "blocks"))


def test_every_family_with_a_known_head_is_cut_here_or_refused() -> None:
    """`pipeline_refusal` lets through every family of `head.HEADS` not in `CUT_REFUSED`: each of them is among
    the families this file checks against the whole model."""
    checked = {_build(name).config.get_text_config().model_type for name in FAMILIES if name not in REFUSED}
    assert set(HEADS) - set(CUT_REFUSED) <= checked, set(HEADS) - set(CUT_REFUSED) - checked


def test_refused_families_are_exactly_these() -> None:
    refused = {}
    for name in FAMILIES:
        model = _build(name)
        reason = pipeline_refusal(model, _layers(model) if _has_layers(model) else 1)
        if reason is not None:
            refused[name] = reason
    assert set(refused) == set(REFUSED), refused
    for name, reason in refused.items():
        assert REFUSED[name] in reason, (name, reason)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in REFUSED])
def test_stages_chained_equal_the_whole_model(name: str) -> None:
    model = _build(name)
    whole = copy.deepcopy(model)
    text = model.config.get_text_config()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, text.vocab_size, (2, 16), generator=g)
    targets = torch.randint(0, text.vocab_size, (2, 16), generator=g)
    positions = torch.arange(16)[None].expand(2, -1)
    logits = whole(input_ids=ids, position_ids=positions, use_cache=False).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    n = _layers(model)
    x = ids
    for stage in split_causal_lm(model, num_stages=n, stages=range(n)):
        x = stage(x, positions)
    F.cross_entropy(x.flatten(0, 1), targets.flatten()).backward()
    assert torch.equal(x, logits)
    grads = dict(whole.named_parameters())
    for key, p in model.named_parameters():
        assert (p.grad is None) == (grads[key].grad is None), key
        assert p.grad is None or torch.equal(p.grad, grads[key].grad), key


def test_a_cut_model_keeps_its_stages_parameters_under_the_full_names() -> None:
    """A rank holding stages 1 and 3 of 4 (an interleaved schedule's): the other layers, the embedding, and
    nothing else dropped; each stage's parameters are the model's own objects."""
    full = _build("llama")
    full.config.num_hidden_layers = 4
    model = hf.AutoModelForCausalLM.from_config(full.config, dtype=torch.float64)
    names = dict(model.named_parameters())
    stages = split_causal_lm(model, num_stages=4, stages=(1, 3))
    kept = dict(model.named_parameters())
    assert set(kept) == {k for k in names if k.startswith(("model.layers.1.", "model.layers.3.", "model.norm.",
                                                           "lm_head."))}
    assert all(kept[k] is names[k] for k in kept)
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in kept.values()}
    assert list(stages[0].layers) == ["1"] and list(stages[1].layers) == ["3"]
    assert stages[0].embed is None and stages[0].lm_head is None and stages[1].lm_head is not None


@pytest.mark.parametrize(("stages", "message"), [
    (3, "has 2 decoder layers, which do not split evenly into 3 pipeline stages"),
    (2, "ties its input and output embeddings (tie_word_embeddings)"),
])
def test_refusals(stages: int, message: str) -> None:
    model = _build("gemma3", untie=stages != 2)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_causal_lm(model, num_stages=stages, stages=(0,))


def test_a_stage_of_feed_forward_layers_alone_is_named() -> None:
    """Nemotron-H's layer types ("mamba", "attention", "mlp") cut in 3: the last stage mixes no token (the trainer
    refuses it under CP, whose region would route nothing); cut in 1, every stage does."""
    model = _build("hybrid:nemotron_h")
    assert stages_without_token_mixing(model, 3) == [2]
    assert stages_without_token_mixing(model, 1) == []
    assert stages_without_token_mixing(_build("llama"), 2) == []


def test_a_cut_model_sets_its_buffers_walking_its_own_layers() -> None:
    """Falcon-H1's `_init_weights` walks every layer's `mamba` for its muP vector: on a rank holding stage 1 of 2
    it does so within `held_layers_only` (the pass-through of layer 0 has none), and sets the held layer's."""
    from cpcompose.integrations.transformers import init_non_persistent_buffers

    model = _build("hybrid:falcon_h1")
    want = model.model.layers[1].mamba.mup_vector.clone()
    split_causal_lm(model, num_stages=2, stages=(1,))
    model.model.layers[1].mamba.mup_vector.zero_()
    with pytest.raises(AttributeError, match="mamba"):
        init_non_persistent_buffers(model)
    with held_layers_only(model):
        init_non_persistent_buffers(model)
    assert torch.equal(model.model.layers[1].mamba.mup_vector, want)
