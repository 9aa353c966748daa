"""The memory plan's profile of a Hugging Face model, from its config.json.

Its parameter counts are exact: they must equal the model transformers builds (on the meta device) for each
profiled family, the hybrid's layers of two kinds included. A family it cannot count is said in one line
by the dry run's memory line, never a number. At tp = 2 the dense families count one tp rank's share, its
parameters against the family's plan and a split Qwen3 layer's saved bytes against `saved_tensors_hooks`. (What the counted tensors add up to is checked against torch's
tracker by tests/training/memory/test_rehearsal.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf

from cpcompose.config import load_config
from cpcompose.training.families.hf.memory import hf_memory_profile
from cpcompose.training.memory.budget import describe_memory

SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, tie_word_embeddings=False)
CONFIGS = {
    "llama": lambda: hf.LlamaConfig(**SMALL, attention_bias=True),
    "mistral": lambda: hf.MistralConfig(**SMALL),
    "qwen2": lambda: hf.Qwen2Config(**SMALL),  # biases on q, k and v only
    "qwen3": lambda: hf.Qwen3Config(**SMALL),
    "qwen3_moe": lambda: hf.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                           mlp_only_layers=[0]),  # one dense layer, three MoE ones
    "qwen3_next": lambda: hf.Qwen3NextConfig(  # linear, linear, linear, full; MoE off the sparse step
        **SMALL, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, decoder_sparse_step=2),
    "deepseek_v3": lambda: hf.DeepseekV3Config(  # MLA; one dense layer, then MoE with the grouped router
        **SMALL, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=2,
        moe_intermediate_size=24, first_k_dense_replace=1),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_profile_counts_the_parameters_transformers_builds(family: str) -> None:
    config = CONFIGS[family]()
    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(config)
    layers = model.model.layers
    profile = hf_memory_profile(config, tp=1, precision="bfloat16-params", mlp_tiles=1)
    assert profile.layers == len(layers)
    assert profile.body_params == sum(p.numel() for p in layers.parameters())
    assert profile.block_params == max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    assert profile.root_params + profile.body_params == sum(p.numel() for p in model.parameters())
    assert profile.output_params == model.lm_head.weight.numel()
    # the experts modules' own parameters: what expert parallelism splits over its ranks
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    assert profile.body_expert_params == sum(p.numel() for m in experts for p in m.parameters())
    assert profile.block_expert_params == max((sum(p.numel() for p in m.parameters()) for m in experts), default=0)


def test_a_family_the_plan_cannot_count_is_said_in_one_line(tmp_path: Path) -> None:
    hf.Lfm2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, layer_types=["conv", "full_attention"]).save_pretrained(tmp_path)
    config = load_config(["--model.name=hf", f"--model.path={tmp_path}", "--training.seq_len=256",
                          "--training.batch_size=1"])
    lines = describe_memory(config, 1)
    assert len(lines) == 1 and "not predicted" in lines[0] and "'lfm2'" in lines[0], lines
    assert "qwen3_next" in lines[0], lines  # it names the families it can count


def test_tied_word_embeddings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="tied word embeddings"):
        hf_memory_profile(hf.Qwen3Config(**{**SMALL, "tie_word_embeddings": True}), tp=1, precision="float32",
                          mlp_tiles=1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_at_tp_the_profile_counts_one_rank_share(family: str) -> None:
    """At tp = 2 a layer's parameters are one tp rank's: the family's plan splits each colwise weight and bias and
    each rowwise weight in two (a rowwise bias, the norms and the per-head q/k norms whole); its attention is that
    rank's heads. A family whose layers are not split has no profile at tp > 1."""
    from cpcompose.integrations.transformers.tensor_parallel import tensor_parallel_plan

    tp, config = 2, CONFIGS[family]()
    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    styles = tensor_parallel_plan(model, list(model.model.layers), tp).styles
    share = sum(p.numel() // (tp if styles.get(owner) == "colwise" or (styles.get(owner) == "rowwise"
                                                                      and leaf == "weight") else 1)
                for name, p in layer.named_parameters() for owner, _, leaf in [name.rpartition(".")])
    profile = hf_memory_profile(config, tp=tp, precision="bfloat16-params", mlp_tiles=1)
    assert profile.block_params == share and profile.body_params == share * len(model.model.layers)
    assert profile.attention == (SMALL["num_attention_heads"] // tp, SMALL["num_key_value_heads"] // tp,
                                 SMALL["head_dim"])
    whole = hf_memory_profile(config, tp=1, precision="bfloat16-params", mlp_tiles=1)
    assert profile.root_params == whole.root_params and profile.block_saved < whole.block_saved
    with pytest.raises(ValueError, match="'qwen3_moe' at parallelism.tp = 2"):
        hf_memory_profile(CONFIGS["qwen3_moe"](), tp=2, precision="float32", mlp_tiles=1)


def test_at_tp_a_layer_saves_what_the_profile_counts(pools) -> None:
    """A Qwen3 layer split over 2 tp ranks (its per-head norms, q, k, v and the feed-forward's columns halved) saves
    per token, counted by `saved_tensors_hooks` on transformers' modules in a CP region, exactly the profile's
    `block_saved` at tp = 2 (float32)."""
    from tests.support.tp_cases import saved_bytes_case

    config = hf.Qwen3Config(vocab_size=64, hidden_size=128, num_hidden_layers=1, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=32, intermediate_size=256)
    measured = pools.get(2).run(saved_bytes_case, config, 64)
    profile = hf_memory_profile(config, tp=2, precision="float32", mlp_tiles=1)
    assert measured == [profile.block_saved] * 2, (measured, profile.block_saved)
