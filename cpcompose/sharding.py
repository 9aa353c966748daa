"""Moving whole tensors between full-sequence and CP-sharded form, differentiably.

`cp_shard` and `cp_unshard` are each other's adjoints:

* `cp_shard` keeps this rank's chunks. Its backward all-gathers the gradient:
  the full tensor was replicated on every rank, and each rank's loss reads only
  its own tokens, so the full gradient is the union of the local ones.
* `cp_unshard` all-gathers and restores global order. Its backward keeps this
  rank's slice of the gradient (the contract of ROLL's context_parallel_gather):
  every rank computes the same loss on the gathered tensor, so each rank's
  shard gets exactly its part of that one loss's gradient.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CPGroup, all_gather
from cpcompose.layout import SeqLayout, resolve_layout
from cpcompose.packing import PackedLayout
from cpcompose.validation import agree_across_ranks, dtype_code, shape_code


def _gather_global(x: Tensor, cp: CPGroup, layout: "Layout", dim: int) -> Tensor:
    """All ranks' shards of `x`, concatenated along `dim` in global order."""
    stacked = all_gather(x.movedim(dim, 0), cp)  # (P, S_local, ...)
    full = stacked.flatten(0, 1)
    return layout.to_global_order(full, dim=0).movedim(0, dim)


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cp: CPGroup, layout: "Layout", dim: int) -> Tensor:
        ctx.cp, ctx.layout, ctx.dim = cp, layout, dim
        return layout.shard(x, dim, cp.rank)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _gather_global(grad.contiguous(), ctx.cp, ctx.layout, ctx.dim), None, None, None


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cp: CPGroup, layout: "Layout", dim: int) -> Tensor:
        ctx.cp, ctx.layout, ctx.dim = cp, layout, dim
        return _gather_global(x, cp, layout, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.layout.shard(grad, ctx.dim, ctx.cp.rank), None, None, None


Layout = Union[SeqLayout, PackedLayout]


def _layout(mesh: DeviceMesh, layout: str | PackedLayout) -> tuple[CPGroup, Layout]:
    cp = CPGroup.from_mesh(mesh)
    if isinstance(layout, PackedLayout):
        if layout.world != cp.world:
            raise ValueError(f"the PackedLayout was built for {layout.world} ranks, the CP mesh has {cp.world}")
        return cp, layout
    return cp, SeqLayout(resolve_layout(layout, is_causal=True), cp.world)


def cp_shard(tensor: Tensor, mesh: DeviceMesh, *, seq_dim: int, layout: str | PackedLayout) -> Tensor:
    """This rank's shard of a full-sequence tensor (same on every rank), differentiable.

    Args:
        tensor: the full tensor, identical on every CP rank.
        mesh: the 1-D CP mesh.
        seq_dim: the sequence dimension.
        layout: "zigzag", "contiguous", or a `PackedLayout` (pad the pack first).

    Raises:
        ValueError: the sequence length cannot be split by the layout, or bad args.
    """
    cp, seq_layout = _layout(mesh, layout)
    dim = seq_dim % tensor.ndim
    seq_layout.check_split(tensor.shape[dim], what=f"cp_shard: size {tensor.shape[dim]} of dim {dim}")
    return _Shard.apply(tensor, cp, seq_layout, dim)


def cp_unshard(tensor: Tensor, mesh: DeviceMesh, *, seq_dim: int, layout: str | PackedLayout) -> Tensor:
    """All-gather CP shards into the full tensor in global order, differentiable.

    The backward returns this rank's slice of the gradient, so compute the same
    loss on every rank from the result (see the module docstring).

    Raises:
        ValueError: on every rank, if the shards differ in shape or dtype between ranks.
    """
    cp, seq_layout = _layout(mesh, layout)
    dim = seq_dim % tensor.ndim
    error = seq_layout.local_len_error(tensor.shape[dim])
    signature = [*shape_code(tensor.shape, 8), dtype_code(tensor.dtype), dim]
    agree_across_ranks(cp, error, signature, what="cp_unshard", device=tensor.device)
    return _Unshard.apply(tensor.contiguous(), cp, seq_layout, dim)


def cp_position_ids(
    seq_len: int, mesh: DeviceMesh, *, layout: str | PackedLayout, device: torch.device | str | None = None
) -> Tensor:
    """Positions of this rank's tokens (int64, local order), for RoPE.

    Global positions for zigzag/contiguous; for a `PackedLayout`, positions within
    each token's document (restarting at 0 at every document).

    Raises:
        ValueError: `seq_len` cannot be split by the layout.
    """
    cp, seq_layout = _layout(mesh, layout)
    seq_layout.check_split(seq_len)
    if isinstance(seq_layout, PackedLayout):
        return seq_layout.position_ids(cp.rank, device)
    return seq_layout.local_indices(cp.rank, seq_len, device)
