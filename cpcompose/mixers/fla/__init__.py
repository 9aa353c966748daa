"""flash-linear-attention's kernel APIs under CP: `chunk_gated_delta_rule` (Gated DeltaNet) and `chunk_kda` (KDA).

Each is `cp(original, region, *the API's arguments)`: `original` is the kernel to run on this
rank's runs (fla's on CUDA, transformers' torch fallback anywhere).
"""

from cpcompose.mixers.fla.delta_rule import cp_chunk_gated_delta_rule, cp_chunk_kimi_delta_attention

__all__ = ["cp_chunk_gated_delta_rule", "cp_chunk_kimi_delta_attention"]
