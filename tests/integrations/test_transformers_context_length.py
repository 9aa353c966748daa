"""`extend_context`: RoPE base, scaling and maximum position merged into a copy of a transformers config.

What the merged settings do to the model is checked where they train (tests/training/
tests/training/families/hf/test_checkpoint.py: step 1 equals transformers' loss under the overridden config); here, what
is merged, what is filled in, and what is refused (each with the argument it names).
"""

from __future__ import annotations

import pytest
import transformers as hf

from cpcompose.integrations.transformers import extend_context

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             max_position_embeddings=4096)


def test_yarn_is_merged_and_told_the_original_length() -> None:
    config = hf.LlamaConfig(**SMALL, rope_theta=500000.0)
    out = extend_context(config, rope_scaling={"rope_type": "yarn", "factor": 4.0}, max_position_embeddings=16384)
    assert out.rope_parameters == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                   "original_max_position_embeddings": 4096}
    assert out.max_position_embeddings == 16384
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}, "the input is left alone"
    assert config.max_position_embeddings == 4096


def test_theta_alone_and_an_explicit_original_length() -> None:
    out = extend_context(hf.Qwen3Config(**SMALL), rope_theta=1e6)
    assert out.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    out = extend_context(hf.Qwen3Config(**SMALL), rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                                "original_max_position_embeddings": 1024})
    assert out.rope_parameters["original_max_position_embeddings"] == 1024


def test_settings_per_layer_type_are_changed_per_layer_type() -> None:
    config = hf.Gemma3TextConfig(**SMALL, head_dim=8, layer_types=["sliding_attention", "full_attention"])
    out = extend_context(config, rope_scaling={"full_attention": {"rope_type": "linear", "factor": 8.0}})
    assert out.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    assert out.rope_parameters["sliding_attention"] == config.rope_parameters["sliding_attention"]


@pytest.mark.parametrize("config,kwargs,message", [
    (hf.GPT2Config(n_embd=16, n_layer=1, n_head=2), {"rope_theta": 1e6}, "rope_theta: GPT2Config has no RoPE"),
    (hf.LlamaConfig(**SMALL), {"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling: transformers refuses.*factor"),
    (hf.LlamaConfig(**SMALL), {"rope_scaling": {"rope_type": "nope"}}, "rope_scaling: rope_type 'nope' is not one"),
    (hf.LlamaConfig(**SMALL), {"rope_scaling": {"factor": 2.0}}, "rope_scaling: sets factor but the rope_type"),
    (hf.LlamaConfig(**SMALL), {"rope_scaling": {"full_attention": {"factor": 2.0}}}, "rope_scaling: full_attention is"),
    (hf.LlamaConfig(**SMALL), {"rope_theta": -1.0}, "rope_theta: must be > 0"),
    (hf.LlamaConfig(**SMALL), {"max_position_embeddings": 0}, "max_position_embeddings: must be >= 1"),
    (hf.Gemma3TextConfig(**SMALL, head_dim=8, layer_types=["sliding_attention", "full_attention"]),
     {"rope_theta": 1e6}, "rope_theta: this model has RoPE settings per layer type"),
    (hf.Gemma3TextConfig(**SMALL, head_dim=8, layer_types=["sliding_attention", "full_attention"]),
     {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_scaling: this model has RoPE settings per layer"),
])
def test_what_a_model_cannot_take_is_refused(config, kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        extend_context(config, **kwargs)
