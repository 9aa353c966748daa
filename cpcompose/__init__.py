"""cpcompose: exact context parallelism for PyTorch, on every device PyTorch runs on."""

from cpcompose.attention import CPContext, CPOptions, cp_attention
from cpcompose.comm import CommMeter
from cpcompose.layouts import ContiguousLayout, Layout, PackedLayout, ZigzagLayout, resolve_layout
from cpcompose.parallel import (
    ContextParallel,
    allreduce_gradients,
    context_parallel,
    context_parallel_unshard,
    cp_cross_entropy,
    cp_linear_cross_entropy,
    parallelize_module,
    recompute_context,
    verify,
)
from cpcompose.sharding import (
    PackedShard,
    cp_distribute,
    cp_from_local,
    cp_full_tensor,
    cp_position_ids,
    cp_shard,
    cp_shard_packed,
    cp_unshard,
    pad_pack,
)

__all__ = [
    "CPContext",
    "CPOptions",
    "CommMeter",
    "ContextParallel",
    "ContiguousLayout",
    "Layout",
    "PackedLayout",
    "PackedShard",
    "ZigzagLayout",
    "allreduce_gradients",
    "context_parallel",
    "context_parallel_unshard",
    "cp_attention",
    "cp_cross_entropy",
    "cp_linear_cross_entropy",
    "cp_distribute",
    "cp_from_local",
    "cp_full_tensor",
    "cp_position_ids",
    "cp_shard",
    "cp_shard_packed",
    "cp_unshard",
    "pad_pack",
    "parallelize_module",
    "recompute_context",
    "resolve_layout",
    "verify",
]
__version__ = "0.1.0"
