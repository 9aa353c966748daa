"""Moving whole tensors between full-sequence and CP-sharded form, differentiably.

`cp_shard` and `cp_unshard` are each other's adjoints:

* `cp_shard` keeps this rank's part. Its backward all-gathers the gradient:
  the full tensor was replicated on every rank, and each rank's loss reads only
  its own tokens, so the full gradient is the union of the local ones.
* `cp_unshard` all-gathers and restores global order. Its backward keeps this
  rank's slice of the gradient (the contract of ROLL's context_parallel_gather):
  every rank computes the same loss on the gathered tensor, so each rank's
  shard gets exactly its part of that one loss's gradient.

Both, and `cp_position_ids`, take the same `layout=` as `cp_attention` and resolve
it with the same resolver (default: zigzag), and all three agree across ranks
before anything moves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CPGroup, all_gather
from cpcompose.layouts import Layout, LayoutSpec, layout_error, resolve_layout
from cpcompose.agreement import agree_across_ranks, dtype_code, shape_fields

__all__ = ["cp_position_ids", "cp_shard", "cp_unshard", "dim_error"]


def _gather_global(x: Tensor, cp: CPGroup, layout: Layout, dim: int) -> Tensor:
    """All ranks' shards of `x`, concatenated along `dim` in global order."""
    stacked = all_gather(x.movedim(dim, 0), cp)  # (P, S_local, ...)
    return layout.to_global_order(stacked.flatten(0, 1), dim=0).movedim(0, dim)


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cp: CPGroup, layout: Layout, dim: int) -> Tensor:
        ctx.cp, ctx.layout, ctx.dim = cp, layout, dim
        return layout.shard(x, dim, cp.rank)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _gather_global(grad.contiguous(), ctx.cp, ctx.layout, ctx.dim), None, None, None


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cp: CPGroup, layout: Layout, dim: int) -> Tensor:
        ctx.cp, ctx.layout, ctx.dim = cp, layout, dim
        return _gather_global(x, cp, layout, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.layout.shard(grad, ctx.dim, ctx.cp.rank), None, None, None


def dim_error(seq_dim: object, ndim: int) -> str | None:
    """Why `seq_dim` is not a dimension of an `ndim`-D tensor (no silent wrap-around), or None."""
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        return f"seq_dim must be an int, got {seq_dim!r}"
    if ndim == 0:
        return "a 0-d tensor has no sequence dimension"
    if not -ndim <= seq_dim < ndim:
        return f"seq_dim={seq_dim} is out of range for a {ndim}-D tensor (valid: {-ndim}..{ndim - 1})"
    return None


def _prepare(
    tensor: Tensor, mesh: DeviceMesh, seq_dim: int, layout: LayoutSpec, what: str, *, local: bool
) -> tuple[CPGroup, Layout, int]:
    """Check on every rank (one tiny all-gather), then the group, layout and dim to use."""
    cp = CPGroup.from_mesh(mesh)
    error = layout_error(layout, cp.world)
    if error is None and not isinstance(tensor, Tensor):
        error = f"expected a tensor, got {type(tensor).__name__}"
    error = error or dim_error(seq_dim, tensor.ndim)
    seq_layout = resolve_layout(layout, cp.world) if error is None else None
    dim = seq_dim % tensor.ndim if error is None else -1
    if seq_layout is not None:
        size = tensor.shape[dim]
        error = (
            seq_layout.local_len_error(size) if local
            else seq_layout.split_error(size, what=f"{what}: size {size} of dim {dim}")
        )
    shape = tensor.shape if isinstance(tensor, Tensor) else ()
    signature = [
        *shape_fields("shape", shape, 8), ("dtype", dtype_code(getattr(tensor, "dtype", None))), ("seq_dim", dim),
        ("layout", -1 if seq_layout is None else seq_layout.identity),
    ]
    device = tensor.device if isinstance(tensor, Tensor) and tensor.device.type != "meta" else torch.device("cpu")
    agree_across_ranks(cp, error, signature, what=what, device=device)
    assert seq_layout is not None
    return cp, seq_layout, dim


def cp_shard(tensor: Tensor, mesh: DeviceMesh, *, seq_dim: int, layout: LayoutSpec = None) -> Tensor:
    """This rank's shard of a full-sequence tensor (same on every rank), differentiable.

    Args:
        tensor: the full tensor, identical on every CP rank.
        mesh: the 1-D CP mesh.
        seq_dim: the sequence dimension.
        layout: "zigzag" (the default), "contiguous", or a `Layout` object such as a
            `PackedLayout` (pad the pack first); pass the same one to the attention.

    Raises:
        ValueError: on every rank, if the sequence cannot be split by the layout or
            the ranks' arguments differ.
    """
    cp, seq_layout, dim = _prepare(tensor, mesh, seq_dim, layout, "cp_shard", local=False)
    return _Shard.apply(tensor, cp, seq_layout, dim)


def cp_unshard(tensor: Tensor, mesh: DeviceMesh, *, seq_dim: int, layout: LayoutSpec = None) -> Tensor:
    """All-gather CP shards into the full tensor in global order, differentiable.

    The backward returns this rank's slice of the gradient, so compute the same
    loss on every rank from the result (see the module docstring).

    Raises:
        ValueError: on every rank, if the shards differ in shape or dtype between ranks.
    """
    cp, seq_layout, dim = _prepare(tensor, mesh, seq_dim, layout, "cp_unshard", local=True)
    return _Unshard.apply(tensor.contiguous(), cp, seq_layout, dim)


def cp_position_ids(
    seq_len: int, mesh: DeviceMesh, *, layout: LayoutSpec = None, device: torch.device | str | None = None
) -> Tensor:
    """Positions of this rank's tokens (int64, local order), for RoPE.

    Global positions for zigzag/contiguous; for a `PackedLayout`, positions within
    each token's document (restarting at 0 at every document).

    Raises:
        ValueError: `seq_len` is not an int or cannot be split by the layout.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise ValueError(f"seq_len must be an int, got {seq_len!r}")
    cp = CPGroup.from_mesh(mesh)
    seq_layout = resolve_layout(layout, cp.world)
    seq_layout.check_split(seq_len)
    return seq_layout.position_ids(cp.rank, seq_len, device)
