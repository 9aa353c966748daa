"""Packed sequences (THD, `cu_seqlens`): split a pack, pad it, shard it.

The split itself is `cpcompose.layouts.PackedLayout`. `pack_documents` is the one path
from documents laid end to end to a packed batch every CP rank agrees on: cu_seqlens ->
balanced layout -> padding -> cross-rank agreement -> this rank's shards. The trainer and
the Hugging Face and torchtitan integrations all call it; where a document starts stays
each caller's rule (EOS tokens, positions restarting at 0, torchtitan's positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.agreement import Signature, agree_across_ranks
from cpcompose.comm import CPGroup
from cpcompose.layouts import PackedLayout
from cpcompose.layouts.packed import Balance

__all__ = ["PackedBatch", "PackedShard", "cp_shard_packed", "pack_documents", "pad_pack"]


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


@dataclass(frozen=True)
class PackedBatch:
    """Documents laid end to end in one row, padded to their layout, the same on every CP rank.

    `tensors` are the caller's full-sequence tensors `(1, layout.seq_len)`, in its order;
    `local(rank)` cuts them by `layout` (what `context_parallel` does to its buffers).
    """

    layout: PackedLayout
    tensors: tuple[Tensor, ...]

    def local(self, rank: int) -> tuple[Tensor, ...]:
        """`rank`'s shard of each tensor, `(1, local_len)`."""
        return tuple(self.layout.shard(t, 1, rank) for t in self.tensors)

    def position_ids(self, rank: int, device: torch.device | str | None = None) -> Tensor:
        """`rank`'s RoPE positions `(1, local_len)`: restarting at 0 in every document."""
        return self.layout.position_ids(rank, device=device)[None]


def pack_documents(
    tensors: Sequence[Tensor],
    cu_seqlens: Sequence[int] | Tensor | None,
    mesh: DeviceMesh,
    *,
    pad_values: Sequence[float | int | None],
    what: str,
    error: str | None = None,
    signature: Signature | None = None,
    balance: Balance = "documents",
    window: int | None = None,
    device: torch.device | None = None,
) -> PackedBatch:
    """Documents laid end to end -> a balanced packed batch, checked on every CP rank.

    Args:
        tensors: token-aligned tensors holding the documents end to end, each with
            `cu_seqlens[-1]` elements (any shape; they are flattened to one row).
        cu_seqlens: where each document starts and the total, from 0 (the caller's rule
            found them); None when the caller's `error` says it could not.
        mesh: the 1-D CP mesh.
        pad_values: per tensor, what its padding document holds (None: positions counting
            from 0, for a position tensor).
        what: the caller's name, for messages.
        error: the caller's complaint about its own input, raised on every rank.
        signature: what else must be equal on every rank (the caller's shapes); the
            layout's identity is added.
        balance, window: how `PackedLayout.build` splits the pack.
        device: where the agreement's tiny tensor lives (CUDA for NCCL); default: the
            first tensor's.

    Raises:
        ValueError: on every CP rank (one tiny all-gather) if any rank's input is invalid
            or the ranks' packs differ.
    """
    cp = CPGroup.from_mesh(mesh)
    layout: PackedLayout | None = None
    if error is None:
        try:
            layout = PackedLayout.build(cu_seqlens if cu_seqlens is not None else [], cp.world, balance=balance,
                                        window=window)
        except ValueError as e:
            error = str(e)
    if error is None and layout is not None and any(t.numel() != layout.seq_len - layout.pad for t in tensors):
        error = f"the tensors hold {[t.numel() for t in tensors]} tokens, the documents {layout.seq_len - layout.pad}"
    if device is None:
        device = tensors[0].device if tensors and isinstance(tensors[0], Tensor) else torch.device("cpu")
    agree_across_ranks(cp, error, Signature(signature or ()).layout(layout), what=what, device=device)
    assert layout is not None
    return PackedBatch(layout, tuple(_pad(t.reshape(1, -1), layout, value) for t, value in zip(tensors, pad_values)))


def _pad(row: Tensor, layout: PackedLayout, value: float | int | None) -> Tensor:
    """One row padded to the layout; `value` None: positions 0, 1, ... in the padding document."""
    if value is not None:
        return pad_pack(row, layout, dim=1, value=value)
    return torch.cat([row, torch.arange(layout.pad, dtype=row.dtype, device=row.device)[None]], dim=1)
