"""Reference models, written as plain ``nn.Module`` code with no ``torch.distributed``."""

from cpcompose.models.llama import (
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    apply_rope,
    rope_cos_sin,
)
from cpcompose.models.pipeline import split_llama_for_pipeline

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "rope_cos_sin",
    "split_llama_for_pipeline",
]
