"""Moving tensors between full-sequence and CP-sharded form: plain tensors, packed documents, CP DTensors."""

from cpcompose.sharding.dtensor import cp_distribute, cp_from_local, cp_full_tensor
from cpcompose.sharding.packed import PackedShard, cp_shard_packed, pad_pack
from cpcompose.sharding.tensors import cp_position_ids, cp_shard, cp_unshard

__all__ = [
    "PackedShard", "cp_distribute", "cp_from_local", "cp_full_tensor", "cp_position_ids", "cp_shard",
    "cp_shard_packed", "cp_unshard", "pad_pack",
]
