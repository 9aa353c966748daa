"""What `Shard(seq)` on the CP mesh means, so DTensors never silently reorder tokens.

A CP DTensor's global sequence is the layout order of its split (rank 0's tokens,
then rank 1's, ...: what `full_tensor()` returns). Under the contiguous layout
that is the global order, so a DTensor made the ordinary way
(`distribute_tensor(x, mesh, [Shard(d)])`) means what it says. Under any other
layout (zigzag, packed) it is a permutation, and it must say which: the DTensor
lives on a view of the CP mesh named `"<cp dim>@<layout tag>"` (same process group,
no new communicator), and the name survives every DTensor op.

* `cp_distribute` / `cp_from_local` make such DTensors (from a global tensor, or
  from this rank's shard); `cp_full_tensor` returns global order.
* Inside a CP region, SDPA (and `ContextParallel`'s DTensor inputs) accept a
  DTensor only if its split is the region's: a tag naming another split, or a
  plain `Shard` when the region is not contiguous, raises on every rank instead
  of attending tokens in the wrong order.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from cpcompose.comm import CPGroup
from cpcompose.layouts import Layout, LayoutSpec, resolve_layout
from cpcompose.sharding.tensors import cp_shard, cp_unshard

__all__ = ["cp_dim_name", "cp_distribute", "cp_from_local", "cp_full_tensor", "layout_mesh", "split_mismatch"]

_TAG_SEP = "@"


def cp_dim_name(mesh: DeviceMesh) -> str:
    """The name of a 1-D CP mesh's dimension, without any layout tag."""
    name = (mesh.mesh_dim_names or ("cp",))[0]
    return name.split(_TAG_SEP, 1)[0]


def layout_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The 1-D CP mesh viewed under a name that carries `layout` (itself if layout order is global order)."""
    CPGroup.from_mesh(mesh)  # 1-D check
    if layout.keeps_global_order:
        return mesh
    name = f"{cp_dim_name(mesh)}{_TAG_SEP}{layout.tag}"
    if mesh.mesh_dim_names == (name,):
        return mesh
    return DeviceMesh.from_group(mesh.get_group(), mesh.device_type, mesh_dim_names=(name,))


def cp_distribute(tensor: Tensor, mesh: DeviceMesh, *, seq_dim: int, layout: LayoutSpec = None) -> DTensor:
    """A DTensor `Shard(seq_dim)` over the layout order of `tensor` (identical on every rank), differentiable.

    Raises:
        ValueError: on every rank, as `cp_shard` does.
    """
    local = cp_shard(tensor, mesh, seq_dim=seq_dim, layout=layout)
    return cp_from_local(local, mesh, seq_dim=seq_dim % tensor.ndim, layout=layout)


def cp_from_local(shard: Tensor, mesh: DeviceMesh, *, seq_dim: int, layout: LayoutSpec = None) -> DTensor:
    """This rank's shard (cut by `layout`) as a CP DTensor; no communication, differentiable."""
    seq_layout = resolve_layout(layout, CPGroup.from_mesh(mesh).world)
    dim = seq_dim % shard.ndim
    return DTensor.from_local(shard, layout_mesh(mesh, seq_layout), [Shard(dim)], run_check=False)


def cp_full_tensor(dtensor: DTensor, *, layout: LayoutSpec = None) -> Tensor:
    """The global-order tensor of a CP DTensor (all-gather), differentiable; inverse of `cp_distribute`.

    Raises:
        ValueError: the DTensor is not 1-D `Shard(d)` on a CP mesh, or its split is not `layout`.
    """
    mesh = dtensor.device_mesh
    if mesh.ndim != 1 or not isinstance(dtensor.placements[0], Shard):
        raise ValueError(f"cp_full_tensor needs a DTensor Shard(d) on a 1-D CP mesh, got {dtensor.placements}")
    seq_layout = resolve_layout(layout, mesh.size())
    error = split_mismatch(dtensor, seq_layout, what="cp_full_tensor")
    if error:
        raise ValueError(error)
    dim = dtensor.placements[0].dim % dtensor.ndim
    return cp_unshard(dtensor.to_local(), mesh, seq_dim=dim, layout=seq_layout)


def split_mismatch(dtensor: DTensor, layout: Layout, *, what: str, cp_name: str | None = None) -> str | None:
    """Why `dtensor`'s sequence is not in `layout` order on the CP mesh dim, or None.

    `cp_name` is the CP dimension's name (from the region's mesh); None takes the
    DTensor's only dimension.
    """
    names = [n.split(_TAG_SEP, 1) for n in (dtensor.device_mesh.mesh_dim_names or ("cp",))]
    base = cp_name if cp_name is not None else names[0][0] if len(names) == 1 else None
    dims = [i for i, parts in enumerate(names) if parts[0] == base]
    if not dims:
        dims_names = dtensor.device_mesh.mesh_dim_names
        return f"{what}: the DTensor's mesh dims {dims_names} do not include the CP dim {base!r}"
    tag = names[dims[0]][1] if len(names[dims[0]]) > 1 else None
    if tag is not None and tag != layout.tag:
        return (
            f"{what}: the DTensor's sequence is in the order of split {tag!r}, but the CP attention uses "
            f"{layout.tag!r}; shard with the same layout object you attend with"
        )
    if tag is None and not layout.keeps_global_order:
        return (
            f"{what}: a DTensor with a plain Shard on the CP mesh holds contiguous chunks of the global "
            f"sequence, but the CP attention uses the {layout.name} layout, whose shards are not contiguous "
            "chunks; make the DTensor with cpcompose.cp_distribute(x, mesh, seq_dim=..., layout=...) (or "
            "cp_from_local for this rank's shard), or pass plain local shards"
        )
    return None
