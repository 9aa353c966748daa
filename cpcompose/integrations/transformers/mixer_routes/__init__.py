"""Token mixers outside attention under CP: transformers' kernel functions, routed inside a CP region.

transformers 5.x computes each token mixer of its hybrid models (Mamba, Mamba2, Gated
DeltaNet, short convolutions, ...) through a few module-level *kernel functions* of the
model's modeling file, each with one fixed API that mamba-ssm, causal-conv1d or
flash-linear-attention also implement: `causal_conv1d_fn`, `mamba_selective_scan`
(mamba_ssm's `selective_scan_fn`), `mamba2_chunk_scan` (mamba_ssm's
`mamba_chunk_scan_combined`), `torch_chunk_gated_delta_rule` (fla's
`chunk_gated_delta_rule`), ... Only these functions see more than one token of the
sequence; the model's own code around them (projections, norms, gates) is per token.

So the integration wraps each of them, in every modeling module that has one: outside a
CP region the wrapper calls the original (transformers is unchanged); inside one it calls
cpcompose's CP version (`ROUTES`; the versions themselves live in `cpcompose.mixers`, by kernel
API: `mamba_ssm`, `fla`, `causal_conv1d`, `transformers_models`, importable without
transformers; this package only routes), which is exact over the global sequence under the
region's layout (documents of a pack restart), running the original on this rank's runs
where it can, so a fast kernel that is installed stays in use (a kernel that takes no
initial state, the selective scan, has its outputs corrected instead of rerun). A fused
path that would see only the local shard (`mamba2_split_conv1d_scan_combined`,
`mamba_inner_fn`) returns None inside a region, which transformers reads as "not available".

RWKV's WKV recurrence is such a function too (`rwkv_linear_attention`, `cpcompose.mixers.transformers_models.rwkv`).

Families that mix tokens by their own code, with no kernel function to wrap, get a CP
version of the narrowest method that sees the sequence (`METHOD_ROUTES`, installed on the
class the same way: the original method outside a region, the CP version inside):
RecurrentGemma's recurrent block (its conv call) and RG-LRU scan, MiniMax's lightning
attention, RWKV's token shifts, xLSTM's mLSTM backend, Qwen4-Exp's n-gram embedding and
dilated PLE conv (all in `cpcompose.mixers.transformers_models`).
Module classes CP cannot make exact (a sparse-attention indexer over every earlier token,
a relative position bias, a mixer with no CP version) are refused by class inside a region
(`REFUSED`, `refused.py`, each with its reason), on every rank alike; anything else that
mixes tokens outside attention is what `cpcompose.parallel.verify` finds.
"""

from cpcompose.integrations.transformers.mixer_routes.registry import METHOD_ROUTES, MODELING_MODULES, REFUSED, ROUTES
from cpcompose.integrations.transformers.mixer_routes.routing import (
    install,
    refused_in,
    routed_functions,
    routed_methods,
)

__all__ = [
    "METHOD_ROUTES", "MODELING_MODULES", "REFUSED", "ROUTES",
    "install", "refused_in", "routed_functions", "routed_methods",
]
