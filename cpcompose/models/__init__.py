"""Model families, each in its own folder as plain ``nn.Module`` code (no ``torch.distributed``)
next to its parallel plan, and the registry the trainer builds them through."""

from cpcompose.models.llama import (
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    apply_rope,
    parallelize_llama,
    rope_cos_sin,
    split_llama_for_pipeline,
    split_llama_for_stages,
)
from cpcompose.models.registry import get_model_spec, model_names
from cpcompose.models.spec import ModelSpec

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "ModelSpec",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "get_model_spec",
    "model_names",
    "parallelize_llama",
    "rope_cos_sin",
    "split_llama_for_pipeline",
    "split_llama_for_stages",
]
