"""`AttentionCall`: what the cost model needs to know about one CP attention call.

Everything in it is agreed across ranks before `cp_attention` communicates (shapes,
dtype, the layout object, the mask, the group size), so every rank builds the same
`AttentionCall` and the choice made from it needs no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.layouts import Layout

__all__ = ["AttentionCall"]


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise TypeError(f"dtype must be a torch dtype or its name, got {dtype!r}")
    return name


@dataclass(frozen=True)
class AttentionCall:
    """One CP attention call, by global sizes.

    Attributes:
        batch, heads, kv_heads, head_dim: as q `(batch, heads, L, head_dim)` and k `(batch, kv_heads, L, head_dim)`.
        v_head_dim: V's head dim (MLA may differ); None = head_dim.
        seq_len: global sequence length L (after padding, for a pack).
        layout: the `Layout` the shards were cut by (its `world` is the CP group size).
        mask: causal or not, and the window (`cpcompose.attention.local.blocks.MaskSpec`).
        dtype: of q, k, v (a torch dtype or its name; stored as the name).
        need_lse: the caller asked for the LSE (all-to-all then sends it home too).
        ring_tiles: the ring's backward sends each round's dK/dV home in this many pieces (`ring_loop.py`).
        head_chunks: all-to-all's chunks of heads run one after another (`strategies/alltoall_chunked.py`); 1: all
            heads at once.
    """

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    layout: Layout
    mask: MaskSpec
    dtype: str = "float32"
    v_head_dim: int | None = None
    need_lse: bool = False
    head_chunks: int = 1
    ring_tiles: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.seq_len % self.layout.world:
            raise ValueError(f"seq_len {self.seq_len} is not a multiple of the layout's world {self.layout.world}")

    @classmethod
    def from_tensors(
        cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: Layout, mask: MaskSpec,
        need_lse: bool = False,
    ) -> AttentionCall:
        """From this rank's local shards `(B, H, L / P, D)`, as `cp_attention` holds them after agreement."""
        return cls(
            batch=q.shape[0], heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[3],
            seq_len=q.shape[2] * layout.world, layout=layout, mask=mask, dtype=q.dtype,
            v_head_dim=v.shape[3], need_lse=need_lse,
        )

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def itemsize(self) -> int:
        """Bytes per element of q, k, v, out."""
        return getattr(torch, self.dtype).itemsize

    @property
    def acc_itemsize(self) -> int:
        """Bytes per element of the float32 (float64 for float64) accumulators and dK/dV in flight."""
        return torch.promote_types(getattr(torch, self.dtype), torch.float32).itemsize

    @property
    def local_len(self) -> int:
        return self.seq_len // self.world
