"""A Hugging Face config with a longer context: RoPE base, RoPE scaling and the maximum position changed.

Extending a model's context (what CP is for) means changing its RoPE: a larger base
(`rope_theta`), a scaling method (`rope_type` yarn, linear, dynamic, llama3, longrope with its
`factor`), and the `max_position_embeddings` the model is told it supports. transformers 5 keeps
the RoPE settings in `config.rope_parameters` (`config.rope_scaling` is its deprecated alias):
one dict, or one per layer type for models whose local and global layers differ (Gemma 3).
`extend_context` merges the changes into a copy of the config and lets transformers validate
them; what the model cannot take (no RoPE at all, a flat change to per-layer-type settings) is a
`ValueError` naming the argument.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

__all__ = ["SCALED_ROPE_TYPES", "extend_context"]

SCALED_ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")
"""RoPE types that scale positions relative to the length the model was trained at."""

_NEEDS_ORIGINAL = ("yarn", "longrope", "llama3")  # transformers reads original_max_position_embeddings for these


def extend_context(
    config: PretrainedConfig,
    *,
    rope_theta: float | None = None,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> PretrainedConfig:
    """A copy of `config` with the context-extension overrides applied (None leaves a setting as it is).

    Args:
        config: a transformers config with RoPE (`rope_parameters`).
        rope_theta: the RoPE base.
        rope_scaling: keys merged over `rope_parameters` (`{"rope_type": "yarn", "factor": 4.0}`); for a model
            with settings per layer type, a dict per layer type (`{"full_attention": {...}}`). A scaling type
            that needs `original_max_position_embeddings` gets the config's `max_position_embeddings` as it was
            before this call, unless the dict or the config already say otherwise.
        max_position_embeddings: the longest sequence the model is told it supports.

    Returns:
        The changed copy (validated by transformers' `validate_rope`).

    Raises:
        ValueError: "<argument>: why", for a model without RoPE, per-layer-type settings given flat (or
            the reverse), a non-positive value, or settings transformers' validation refuses.
    """
    config = copy.deepcopy(config)
    if max_position_embeddings is not None and max_position_embeddings < 1:
        raise ValueError(f"max_position_embeddings: must be >= 1, got {max_position_embeddings}")
    if rope_theta is not None and not rope_theta > 0:
        raise ValueError(f"rope_theta: must be > 0, got {rope_theta}")
    original_max = getattr(config, "max_position_embeddings", None)
    if rope_theta is not None or rope_scaling:
        params = copy.deepcopy(getattr(config, "rope_parameters", None))
        name = "rope_theta" if rope_theta is not None else "rope_scaling"
        if not params or not hasattr(config, "nested_rope_parameter_keys"):
            raise ValueError(f"{name}: {type(config).__name__} has no RoPE parameters (config.rope_parameters is "
                             "empty), so its positions cannot be rescaled this way")
        nested = config.nested_rope_parameter_keys(params)
        if nested:
            params = _nested(params, nested, rope_theta, rope_scaling or {}, original_max)
        else:
            params = _merged(params, rope_theta, rope_scaling or {}, original_max, "rope_scaling", nested=())
        config.rope_parameters = params
    if max_position_embeddings is not None:
        if original_max is None:
            raise ValueError(f"max_position_embeddings: {type(config).__name__} has no max_position_embeddings")
        config.max_position_embeddings = max_position_embeddings
    try:
        config.validate_rope()
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"rope_scaling: transformers refuses the RoPE settings {config.rope_parameters}: {e}") from None
    return config


def _merged(params: dict[str, Any], rope_theta: float | None, scaling: dict[str, Any], original_max: int | None,
            where: str, nested: tuple[str, ...]) -> dict[str, Any]:
    """One RoPE dict with the overrides merged in."""
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: expected a table of RoPE settings, got {scaling!r}")
    clash = [k for k in scaling if isinstance(scaling[k], dict)]
    if clash and not nested:
        raise ValueError(f"{where}: {', '.join(clash)} is a table, but this model has one set of RoPE settings for "
                         "every layer; give the settings themselves (rope_type, factor, ...)")
    merged = {**params, **scaling}
    if rope_theta is not None:
        merged["rope_theta"] = float(rope_theta)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if "rope_type" in scaling and rope_type not in ("default", *ROPE_INIT_FUNCTIONS):
        raise ValueError(f"{where}: rope_type {rope_type!r} is not one transformers knows "
                         f"({', '.join(('default', *ROPE_INIT_FUNCTIONS))})")
    ignored = sorted(set(scaling) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if rope_type == "default" and ignored:
        raise ValueError(f"{where}: sets {', '.join(ignored)} but the rope_type is 'default' (no scaling), which "
                         f"ignores them; add rope_type = one of {', '.join(SCALED_ROPE_TYPES)}")
    if rope_type in _NEEDS_ORIGINAL and "original_max_position_embeddings" not in merged and original_max:
        merged["original_max_position_embeddings"] = original_max  # the length the model was trained at
    return merged


def _nested(params: dict[str, Any], nested: list[str], rope_theta: float | None, scaling: dict[str, Any],
            original_max: int | None) -> dict[str, Any]:
    """RoPE dicts per layer type: overrides must name the layer types they change."""
    if rope_theta is not None:
        raise ValueError(
            f"rope_theta: this model has RoPE settings per layer type ({', '.join(nested)}); set rope_theta inside "
            f"rope_scaling for the layer types to change, e.g. rope_scaling = {{{nested[0]!r}: {{'rope_theta': ...}}}}"
        )
    unknown = [k for k in scaling if k not in nested]
    if unknown:
        raise ValueError(
            f"rope_scaling: this model has RoPE settings per layer type ({', '.join(nested)}); give a table for each "
            f"layer type to change (got {', '.join(map(str, unknown))}), e.g. rope_scaling = "
            f"{{{nested[0]!r}: {{'rope_type': 'linear', 'factor': 8.0}}}}"
        )
    out = dict(params)
    for layer_type, change in scaling.items():
        out[layer_type] = _merged(params[layer_type] or {}, None, change, original_max,
                                  f"rope_scaling.{layer_type}", nested=())
    return out
