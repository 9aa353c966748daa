"""Hugging Face families CP cannot make exact, refused by class on every rank inside a CP region.

Each family's attention needs what a rank's shard cannot give (`mixer_routes/refused.py`):
GLM-5.3's DSA and Qwen4-Exp's QSA select keys per query with an indexer over every
earlier token; the Inkling families add a relative position bias computed per query
(Inkling 2 also per-query sinks, and attention over depth through the attention
interface). A tiny model of each, built with attn_implementation="cpcompose", raises
inside a region on every rank: from the first-use probe (which names the module before
any collective) and, with verify=False, from the class itself. The same group then runs
a valid step, exact against its single-process reference: no rank was left behind.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
import transformers as hf

from cpcompose import context_parallel
from cpcompose.integrations.transformers import cpcompose_attention_forward, cpcompose_mask
from tests.support import hybrid_cases as cases

V = 64
EAGER = dict(rtol=1e-4, atol=1e-7)
"""transformers' eager attention takes its softmax in float32 even in a float64 model."""
_INKLING = dict(
    vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8, d_rel=4,
    rel_extent=16, moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1, unpadded_vocab_size=V,
    **cases.SPECIAL,
)
_GLM5_TEXT = dict(
    vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0,
    qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
    layer_types=["linear_attention", "indexed_attention"], mlp_layer_types=["dense", "sparse"], linear_head_dim=8,
    linear_num_heads=4, linear_conv_kernel_dim=4, index_topk=8, index_head_dim=8, index_n_heads=2, index_kpool=4,
    hc_mult=2, hc_sinkhorn_iters=3, **cases.SPECIAL,
)
_GLM5_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                    projection_intermediate_size=16, patch_size=2, image_size=4)

# name -> (the model's class, its config, the refused class the message names, a phrase of its reason)
FAMILIES: dict[str, tuple[type, Callable[[], hf.PretrainedConfig], str, str]] = {
    "glm5_next": (hf.AutoModelForImageTextToText, lambda: hf.Glm5NextConfig(
        text_config=_GLM5_TEXT, vision_config=_GLM5_VISION), "Glm5NextTextAttention", "DeepSeek sparse attention"),
    "qwen4_exp": (hf.AutoModelForCausalLM, lambda: hf.Qwen4ExpTextConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["linear_attention", "indexed_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=2, num_experts_per_tok=1, hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4, **cases.SPECIAL),
        "Qwen4ExpTextAttention", "QSA sparse attention"),
    "inkling": (hf.AutoModelForCausalLM, lambda: hf.InklingTextConfig(
        **_INKLING, intermediate_size=64, n_shared_experts=1), "InklingAttention", "relative position bias"),
    "inkling2": (hf.AutoModelForCausalLM, lambda: hf.Inkling2TextConfig(**_INKLING, n_layers_per_attn_res_block=1),
                 "Inkling2SlidingAttention", "relative position bias"),
    "inkling2_loop": (hf.AutoModelForCausalLM, lambda: hf.Inkling2LoopTextConfig(
        **_INKLING | dict(num_hidden_layers=3), n_layers_per_attn_res_block=1, loop_layer_index_start=1,
        loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8), "Inkling2Loop", "not supported under CP"),
}


def _build(name: str) -> torch.nn.Module:
    auto, config, _, _ = FAMILIES[name]
    torch.manual_seed(0)
    return auto.from_config(config(), dtype=torch.float64, attn_implementation="cpcompose",
                            experts_implementation="eager")


def _region_message(mesh, model, ids: torch.Tensor, verify: bool) -> str:
    """`model`'s forward on `ids` in a CP region: the ValueError it raised, or "no error"."""
    positions = torch.arange(ids.shape[1]).expand_as(ids).clone()
    try:
        with context_parallel(mesh, buffers=[ids, positions], buffer_seq_dims=[1, 1], verify=verify):
            model(input_ids=ids, position_ids=positions, use_cache=False)
    except ValueError as e:
        return str(e)
    return "no error"


def refused_then_valid(mesh, name: str, state: dict) -> dict:
    """The refused family's forward in a region, with the probe and without; then a valid hybrid step."""
    model = _build(name)
    def ids() -> torch.Tensor:  # a fresh batch for each region (its buffers are sharded in place)
        return torch.randint(2, V, (1, 32), generator=torch.Generator().manual_seed(0))

    messages = {verify: _region_message(mesh, model, ids(), verify) for verify in (True, False)}
    return {"messages": messages, "valid": cases.cp_plain(mesh, "lfm2", state, strategies=("ring",))}


@pytest.fixture(scope="module")
def valid_reference() -> tuple[dict, dict]:
    return cases.reference_plain("lfm2")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_refused_on_every_rank_then_the_group_runs_a_valid_step(pools, valid_reference, name: str,
                                                                world: int) -> None:
    _, _, cls, reason = FAMILIES[name]
    want, state = valid_reference
    results = pools.get(world).run(refused_then_valid, name, state)
    for rank, got in enumerate(results):
        probe, forward = got["messages"][True], got["messages"][False]
        assert probe.startswith("cpcompose cannot make this model exact under CP") and cls in probe, (rank, probe)
        assert reason in probe, (rank, probe)
        assert cls in forward and "cannot be made exact under CP" in forward and reason in forward, (rank, forward)
    assert len({r["messages"][False] for r in results}) == 1  # the same error on every rank
    cases.assert_matches(want, [r["valid"] for r in results], "lfm2", f"P={world} after a refusal")


def eager_on_one_rank(mesh, name: str, state: dict) -> dict:
    """A hybrid built with eager attention on rank 1 and "cpcompose" on the others, with the probe and without:
    the ranks agree before any layer runs; then a valid step in the same group."""
    messages = {}
    for verify in (True, False):
        model = cases.build(name, state)
        if mesh.get_local_rank() == 1:
            model = cases.HYBRIDS[name].auto.from_config(cases.HYBRIDS[name].config(), dtype=torch.float64,
                                                         experts_implementation="eager", attn_implementation="eager")
        messages[verify] = _region_message(mesh, model, cases.plain_batch()[0], verify)
    return {"messages": messages, "valid": cases.cp_plain(mesh, name, state, strategies=("ring",))}


def test_attention_outside_cp_on_one_rank_is_refused_everywhere(pools, valid_reference) -> None:
    """A hybrid whose attention is transformers' eager code would attend over the rank's shard alone, and its mixers'
    CP calls hid that from the region's end-of-forward check (LFM2: logits off by up to 0.16 with verify=False).
    Every rank refuses on the model's first forward in the region, naming the implementation to use."""
    want, state = valid_reference
    results = pools.get(2).run(eager_on_one_rank, "lfm2", state)
    for verify in (True, False):
        messages = {got["messages"][verify] for got in results}
        assert len(messages) == 1, messages  # the same error on every rank
        message = messages.pop()
        assert "rank 1: Lfm2ForCausalLM was built with attn_implementation='eager'" in message, message
        assert 'attn_implementation="cpcompose"' in message and "rank 0" not in message, message
    cases.assert_matches(want, [r["valid"] for r in results], "lfm2", "P=2 after a refusal")


def per_query_sinks(mesh) -> dict:
    """An attention call whose kwargs carry per-query sinks on one rank only (what Inkling 2 passes): refused on
    every rank by CP attention itself, whatever class calls it; then a valid call in the same group."""
    rank, module = mesh.get_local_rank(), torch.nn.Module()
    module.is_causal, module.layer_idx = True, 0
    q = torch.randn(1, 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    sinks = torch.zeros(1, 2, 8, 1, dtype=torch.float64) if rank == 1 else None
    try:
        with context_parallel(mesh, verify=False):
            cpcompose_attention_forward(module, q, q, q, None, sinks=sinks)
        message = "no error"
    except ValueError as e:
        message = str(e)
    with context_parallel(mesh, verify=False):
        out = cpcompose_attention_forward(module, q, q, q, None)[0]
    return {"message": message, "shape": tuple(out.shape)}


def test_per_query_sinks_on_one_rank_are_refused_everywhere(pools) -> None:
    for got in pools.get(2).run(per_query_sinks):
        assert "rank 1: Module (layer 0): attention sinks per query (sinks=...) are not supported" in got["message"]
        assert got["shape"] == (1, 8, 2, 8)


def _recording(calls: list) -> Callable:
    def record(module, query, key, value, attention_mask, **kwargs):
        calls.append((module, query, key, value, attention_mask, kwargs))
        return cpcompose_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return record


hf.AttentionInterface.register("cpcompose_recorded", _recording(RECORDED := []))
hf.AttentionMaskInterface.register("cpcompose_recorded", cpcompose_mask)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_outside_a_region_the_refused_model_runs_as_eager(name: str) -> None:
    """A refusal holds inside a CP region only: on one process the same model runs, and "cpcompose" computes
    each attention call as the family's eager function does, to float32's rounding (`EAGER`): Inkling's relative position
    bias and Inkling 2's per-query sinks included (before they were taken, the logits missed by 1e-6 to 4e-2).

    Eager takes its softmax in float32, even in a float64 model: the calls agree to float32's rounding
    (measured up to 8e-8 absolute; without the bias or the sinks they missed by 2e-3 to 1)."""
    auto, config, _, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = auto.from_config(config(), dtype=torch.float64, attn_implementation="cpcompose_recorded",
                             experts_implementation="eager")
    RECORDED.clear()
    logits = model(input_ids=torch.randint(2, V, (1, 16), generator=torch.Generator().manual_seed(0)),
                   use_cache=False).logits
    assert logits.shape == (1, 16, V) and bool(torch.isfinite(logits).all()) and RECORDED
    eager = importlib.import_module(f"transformers.models.{name}.modeling_{name}").eager_attention_forward
    for module, query, key, value, mask, kwargs in RECORDED:
        if mask is not None and mask.dtype == torch.bool:  # eager adds its mask: 0 where seen, the minimum where not
            mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, torch.finfo(query.dtype).min)
        want = eager(module, query, key, value, mask, **kwargs)[0]
        got = cpcompose_attention_forward(module, query, key, value, mask, **kwargs)[0]
        torch.testing.assert_close(got, want, **EAGER, msg=lambda m: f"{type(module).__name__}: {m}")
