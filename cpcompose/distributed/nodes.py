"""Which mesh dimensions a node holds and which cross nodes, under torchrun's rank order.

torchrun gives each node (each agent) `LOCAL_WORLD_SIZE` consecutive global ranks: node k holds ranks
k*L .. k*L + L - 1. The mesh (`parallel_dims.MESH_DIM_NAMES`) is row-major with ``tp`` innermost, then
``cp``, ``dp_shard``, ``dp_replicate`` and ``pp`` outermost, so the innermost dimensions fill a node first:
the ones that talk most (tensor parallelism's all-reduces in every layer, CP attention's exchanges) sit on a
node's fast links, and the ones that talk least per byte of compute (FSDP's gathers, overlapped with compute;
data-parallel replicas; pipeline stages' point-to-point sends) cross nodes. This is the order torchtitan
uses; nothing here reorders the mesh, it only says where each dimension lands.

A dimension of size n whose group members are ``stride`` ranks apart (the product of the sizes inside it)
is, for L ranks per node:

* inside a node when stride*n divides L (every group lies in one node);
* across nodes when L divides stride (each member on another node);
* split when stride divides L and L divides stride*n: L/stride members per node, on stride*n/L nodes
  (cp = 16 on nodes of 8: 8 inside, 2 nodes; its ring crosses, an all-to-all block of 8 does not);
* uneven otherwise: some groups straddle a node boundary with unequal parts (cp = 3 on nodes of 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cpcompose.distributed.parallel_dims import MESH_DIM_NAMES, ParallelDims

__all__ = ["DimPlacement", "NodePlacement", "place_on_nodes"]

Where = Literal["inside", "across", "split", "uneven"]


@dataclass(frozen=True)
class DimPlacement:
    """One mesh dimension (degree > 1) and where its groups lie."""

    name: str
    size: int
    stride: int
    """Global ranks between consecutive members of one of its groups."""
    where: Where
    per_node: int
    """Members of one group on one node (split: L / stride; inside: size; across: 1; uneven: the most)."""


@dataclass(frozen=True)
class NodePlacement:
    """The mesh's dimensions on `nodes` nodes of `ranks_per_node` consecutive ranks."""

    ranks_per_node: int
    nodes: int
    dims: tuple[DimPlacement, ...]
    """The dimensions of degree > 1, innermost first."""

    def of(self, name: str) -> DimPlacement | None:
        """The placement of dimension `name`, None when its degree is 1."""
        return next((d for d in self.dims if d.name == name), None)

    def line(self) -> str:
        """The banner's line: "nodes: 2 x 4 ranks; inside a node: tp 2 x cp 2 (4 ranks); across nodes: dp_shard 2"."""
        inside = [f"{d.name} {d.size}" for d in self.dims if d.where == "inside"]
        inside += [f"{d.name} {d.per_node} of {d.size}" for d in self.dims if d.where == "split"]
        across = [f"{d.name} {d.size}" if d.where == "across" else
                  f"{d.name} {d.size} = {d.per_node} per node x {d.size // d.per_node} nodes"
                  for d in self.dims if d.where in ("across", "split")]
        uneven = [f"{d.name} {d.size}" for d in self.dims if d.where == "uneven"]
        held = 1
        for d in self.dims:
            held *= d.size if d.where == "inside" else d.per_node if d.where == "split" else 1
        parts = [f"nodes: {self.nodes} x {self.ranks_per_node} ranks",
                 f"inside a node: {' x '.join(inside)} ({held} ranks)" if inside else "inside a node: nothing",
                 f"across nodes: {', '.join(across)}" if across else "across nodes: nothing"]
        if uneven:
            parts.append(f"straddling node boundaries unevenly: {', '.join(uneven)}")
        return "; ".join(parts)


def place_on_nodes(dims: ParallelDims, ranks_per_node: int) -> NodePlacement:
    """Where each dimension of `dims`'s mesh lands on nodes of `ranks_per_node` consecutive ranks.

    Raises:
        ValueError: `ranks_per_node` does not divide the world size (nodes of different sizes).
    """
    if ranks_per_node < 1 or dims.world_size % ranks_per_node:
        raise ValueError(f"{ranks_per_node} ranks per node do not divide the world size {dims.world_size}")
    placed, stride, L = [], 1, ranks_per_node
    for name in reversed(MESH_DIM_NAMES):  # innermost first
        n = getattr(dims, name)
        if n == 1:
            continue
        if L % (stride * n) == 0:
            where, per_node = "inside", n
        elif stride % L == 0:
            where, per_node = "across", 1
        elif L % stride == 0 and (stride * n) % L == 0:
            where, per_node = "split", L // stride
        else:
            where, per_node = "uneven", min(n, -(-L // stride))
        placed.append(DimPlacement(name, n, stride, where, per_node))
        stride *= n
    return NodePlacement(L, dims.world_size // L, tuple(placed))
