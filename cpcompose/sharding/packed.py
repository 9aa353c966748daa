"""Packed sequences (THD, `cu_seqlens`) for users: split a pack, pad it, shard it.

The split itself is `cpcompose.layouts.PackedLayout`; this module is the short path
from a pack's `cu_seqlens` to what one rank feeds its model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CPGroup
from cpcompose.layouts import PackedLayout
from cpcompose.layouts.packed import Balance


@dataclass(frozen=True)
class PackedShard:
    """This rank's view of a packed sequence: what to feed the model and the attention."""

    layout: PackedLayout  # pass it as `layout=` to cp_attention / ContextParallel / context_parallel
    indices: Tensor  # global positions of the local tokens (index the padded pack with them)
    position_ids: Tensor  # positions within each document, for RoPE


def cp_shard_packed(
    cu_seqlens: Sequence[int] | Tensor,
    mesh: DeviceMesh,
    *,
    balance: Balance = "documents",
    window: int | None = None,
) -> PackedShard:
    """Split a pack across the CP mesh with balanced attention work.

    Gather this rank's tokens with `tensor.index_select(seq_dim, shard.indices)`
    (pad the pack by `shard.layout.pad` tokens first, e.g. with `pad_pack`), feed
    `shard.position_ids` to RoPE, and pass `layout=shard.layout` to `cp_attention`
    (or the CP style / context manager): attention then uses exactly this split.

    Raises:
        ValueError: invalid `cu_seqlens`, `balance` or `window`.
    """
    cp = CPGroup.from_mesh(mesh)
    layout = PackedLayout.build(cu_seqlens, cp.world, balance=balance, window=window)
    return PackedShard(layout, layout.local_indices(cp.rank), layout.position_ids(cp.rank))


def pad_pack(x: Tensor, layout: PackedLayout, *, dim: int, value: float | int = 0) -> Tensor:
    """Append the layout's padding tokens to a full pack along `dim`."""
    if not layout.pad:
        return x
    shape = list(x.shape)
    shape[dim] = layout.pad
    return torch.cat([x, x.new_full(shape, value)], dim=dim)
