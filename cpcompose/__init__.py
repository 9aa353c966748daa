"""cpcompose: exact context parallelism for PyTorch, on every device PyTorch runs on."""

from cpcompose.attention import cp_attention
from cpcompose.comm import CommMeter
from cpcompose.distributed import ParallelDims
from cpcompose.packing import PackedLayout, PackedShard, cp_shard_packed, pad_pack
from cpcompose.parallel import (
    ContextParallel,
    allreduce_gradients,
    context_parallel,
    context_parallel_unshard,
    cp_cross_entropy,
)
from cpcompose.sharding import cp_position_ids, cp_shard, cp_unshard

__all__ = [
    "CommMeter",
    "ContextParallel",
    "PackedLayout",
    "PackedShard",
    "ParallelDims",
    "allreduce_gradients",
    "context_parallel",
    "context_parallel_unshard",
    "cp_attention",
    "cp_cross_entropy",
    "cp_position_ids",
    "cp_shard",
    "cp_shard_packed",
    "cp_unshard",
    "pad_pack",
]
__version__ = "0.1.0"
