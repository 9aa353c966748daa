"""transformers models under tensor parallelism (the family's own plan, torch's styles) give one process's loss and
gradients, composed with CP and FSDP2; what cannot be split is refused by name.

The matrix (`tests/support/tp_cases.py`): tiny float64 Llama (GQA) and Qwen3 (per-head q/k norms, random) on 4
ranks, at tp = 2 x cp = 2 (heads over tp, the sequence over cp, activation checkpointing re-entering the CP region,
FSDP2 over cp on top of the tp split) and tp = 2 x dp_shard = 2 (FSDP2 over dp_shard, each dp rank its rows), one
pool launch for both. The loss and every gradient equal transformers' on one process over the whole batch.

Tolerance (tests/support/tolerance.py): float64's epsilon x the longest reduction (a weight gradient sums over
tokens x width <= 64 x 64 terms) x the model's largest gradient (a norm's gradient cancels far below its terms).
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as hf

from cpcompose.integrations.transformers.tensor_parallel import (
    TRAINER_PLAN,
    family_plan,
    tensor_parallel_plan,
)
from tests.support import tp_cases
from tests.support.hf_trainer import _moe_config
from tests.support.tolerance import assert_close

SPLITS = [(1, 2, 2, True), (2, 1, 2, False)]  # (dp_shard, cp, tp, activation checkpointing) on 4 ranks
TERMS = tp_cases.ROWS * tp_cases.SEQ * 64


@functools.cache
def _references() -> tuple[dict[str, dict], dict[str, dict]]:
    wants, states = {}, {}
    for name in tp_cases.FAMILIES:
        wants[name], states[name] = tp_cases.reference(name)
    return wants, states


def test_tp_with_cp_and_with_fsdp_equals_one_process(pools) -> None:
    """Llama and Qwen3 at tp = 2 x cp = 2 and tp = 2 x dp_shard = 2: the loss and every gradient (the per-head norms'
    summed over tp) equal one process's in float64, and the projections are split as the plan says."""
    wants, states = _references()
    per_rank = pools.get(4).run(tp_cases.case, SPLITS, states)
    failures = []
    for name, want in wants.items():
        largest = max(g.abs().max().item() for g in want["grads"].values())
        for dp_shard, cp, tp, _ in SPLITS:
            got = per_rank[0][dp_shard, cp, tp, name]
            at = f"{name} dp_shard={dp_shard} cp={cp} tp={tp}"
            assert got["grads"].keys() == want["grads"].keys(), at
            # q_proj: 4 heads of 8 split over tp, then FSDP's share of them (dp_shard x cp = 2)
            assert got["split"]["model.layers.0.self_attn.q_proj.weight"] == (32 // tp // 2, 32), at
            for rank, results in enumerate(per_rank):
                try:
                    assert_close(results[dp_shard, cp, tp, name]["loss"], want["loss"], terms=TERMS)
                except AssertionError as e:
                    failures.append(f"{at} rank {rank} loss: {str(e).splitlines()[0:4]}")
            for param, grad in got["grads"].items():
                try:
                    assert_close(grad, want["grads"][param], terms=TERMS, scale=largest)
                except AssertionError as e:
                    failures.append(f"{at} {param}: {str(e).splitlines()[0:4]}")
    assert not failures, "\n".join(failures)


def _meta(config: hf.PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return hf.AutoModelForCausalLM.from_config(config)


SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=1)


def test_the_family_plan_or_the_trainer_own() -> None:
    """Qwen3's plan as transformers writes it (its per-head norms included); a Llama whose config declares no plan
    gets the trainer's own, which is Llama's."""
    qwen3 = _meta(hf.Qwen3Config(**SMALL, head_dim=8))
    plan = tensor_parallel_plan(qwen3, list(qwen3.model.layers), 2)
    assert plan.source == "the family's" and plan.styles == family_plan(qwen3)
    assert plan.styles["self_attn.q_norm"] == "replicated_with_grad_allreduce"
    config = hf.LlamaConfig(**SMALL)
    config.base_model_tp_plan = {}
    llama = _meta(config)
    llama.model._tp_plan = {}
    plan = tensor_parallel_plan(llama, list(llama.model.layers), 2)
    assert plan.source == "the trainer's own" and dict(plan.styles) == dict(TRAINER_PLAN)


def test_what_cannot_be_split_is_refused_by_name() -> None:
    """Heads and kv heads tp does not divide, a width it does not divide, a mixer with no tensor-parallel form, experts,
    attention sinks, a norm over the whole projected width, a style the trainer does not apply: each named."""
    cases = [
        (hf.LlamaConfig(**{**SMALL, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}), 4,
         ["4 does not divide the model's 6 attention heads (num_attention_heads)",
          "4 does not divide the model's 3 kv heads (num_key_value_heads)"]),
        (hf.LlamaConfig(**{**SMALL, "intermediate_size": 66}), 4,
         ["Linear (model.layers.0.mlp.gate_proj) has 66 output features, which 4 tensor-parallel ranks do not split "
          "evenly"]),
        (_moe_config("qwen3_next", {"vocab_size": 64}), 2,
         ["Qwen3NextGatedDeltaNet (model.layers.0.linear_attn) has no tensor-parallel form here",
          "'colwise_gather_output'", "Qwen3NextSparseMoeBlock (model.layers.0.mlp) holds experts"]),
        (_moe_config("mixtral", {"vocab_size": 64}), 2,
         ["MixtralSparseMoeBlock (model.layers.0.mlp) holds experts, which expert parallelism (parallelism.ep) "
          "splits"]),
        (_moe_config("gpt_oss", {"vocab_size": 64}), 2,
         ["GptOssAttention (model.layers.0.self_attn) holds sinks (4,)"]),
        (hf.Olmo2Config(**SMALL), 2,
         ["Olmo2Attention (model.layers.0.self_attn) has a norm (self_attn.q_norm) that normalizes over the whole "
          "projected width (32"]),
        (hf.Phi3Config(**SMALL), 2, ["Phi3Attention (model.layers.0.self_attn) has no tensor-parallel form here: "
                                     "the family's plan splits self_attn.o_proj as 'rowwise_split_input'"]),
        (hf.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=4, pad_token_id=0,
                        bos_token_id=1, eos_token_id=1), 2,
         ["MambaMixer (backbone.layers.0.mixer) has no tensor-parallel form"]),
    ]
    for config, tp, phrases in cases:
        model = _meta(config)
        base = getattr(model, model.base_model_prefix)
        with pytest.raises(ValueError) as e:
            tensor_parallel_plan(model, list(base.layers), tp, prefix=f"{model.base_model_prefix}.layers")
        for phrase in phrases:
            assert phrase in str(e.value), (type(config).__name__, str(e.value))
        assert "model.layers.1." not in str(e.value), "each reason once, at its first layer"
