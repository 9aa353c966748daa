"""The Llama family: the model (``model.py``), its parallel plan (``parallelize.py``),
its pipeline split (``pipeline.py``), and the :class:`ModelSpec` the trainer builds it through."""

from __future__ import annotations

from typing import Protocol

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
from cpcompose.models.llama.memory import llama_memory
from cpcompose.models.llama.parallelize import parallelize_llama
from cpcompose.models.llama.pipeline import split_llama_for_pipeline, split_llama_for_stages
from cpcompose.models.spec import ModelSpec

__all__ = [
    "SPEC", "Attention", "FeedForward", "Llama", "LlamaConfig", "LlamaSettings", "RMSNorm", "TransformerBlock",
    "apply_rope", "build_llama", "llama_config", "llama_memory", "parallelize_llama", "rope_cos_sin", "split_llama_for_pipeline",
    "split_llama_for_stages",
]


class LlamaSettings(Protocol):
    """The fields of a config's ``model`` section a Llama is built from."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    norm_eps: float
    rope_theta: float | None  # None: LlamaConfig's default


def llama_config(model: LlamaSettings, *, max_seq_len: int) -> LlamaConfig:
    """A config's ``model`` section as a :class:`LlamaConfig` for rows of up to ``max_seq_len`` tokens."""
    return LlamaConfig(
        vocab_size=model.vocab_size, dim=model.dim, n_layers=model.n_layers, n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads, ffn_hidden_dim=model.ffn_hidden_dim, norm_eps=model.norm_eps,
        rope_theta=LlamaConfig.rope_theta if model.rope_theta is None else model.rope_theta, max_seq_len=max_seq_len,
    )


def build_llama(model: LlamaSettings, *, max_seq_len: int) -> Llama:
    """A :class:`Llama` shaped as the ``model`` section says (weights not yet initialised: see ``init_weights``)."""
    return Llama(llama_config(model, max_seq_len=max_seq_len))


SPEC = ModelSpec(
    name="llama", build=build_llama, parallelize=parallelize_llama, split_for_pipeline=split_llama_for_stages,
    memory=llama_memory,
)
