"""The Llama family: the model (``model.py``), its parallel plan (``parallelize.py``),
its pipeline split (``pipeline.py``), and the :class:`ModelSpec` the trainer builds it through."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpcompose.models.llama.model import (
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    apply_rope,
    rope_cos_sin,
)
from cpcompose.models.llama.parallelize import parallelize_llama
from cpcompose.models.llama.pipeline import split_llama_for_pipeline
from cpcompose.models.spec import ModelSpec

if TYPE_CHECKING:  # the config imports the registry, so only type-check against it
    from cpcompose.config import JobConfig

__all__ = [
    "SPEC", "Attention", "FeedForward", "Llama", "LlamaConfig", "RMSNorm", "TransformerBlock",
    "apply_rope", "build_llama", "llama_config", "parallelize_llama", "rope_cos_sin", "split_llama_for_pipeline",
]


def llama_config(config: JobConfig) -> LlamaConfig:
    """The config's ``model`` section as a :class:`LlamaConfig`."""
    m = config.model
    return LlamaConfig(
        vocab_size=m.vocab_size, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
        ffn_hidden_dim=m.ffn_hidden_dim, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        # A packed micro-batch is one sequence of all its samples' tokens.
        max_seq_len=config.training.seq_len * (config.training.batch_size if config.data.pack else 1),
    )


def build_llama(config: JobConfig) -> Llama:
    """A :class:`Llama` shaped as the config says (weights not yet initialised: see ``init_weights``)."""
    return Llama(llama_config(config))


SPEC = ModelSpec(
    name="llama", build=build_llama, parallelize=parallelize_llama, split_for_pipeline=split_llama_for_pipeline
)
