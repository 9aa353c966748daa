"""The mesh against the nodes, before any rank starts: refused where it cannot fit, warned where it is slow.

torchrun tells every process how many ranks its node runs (`LOCAL_WORLD_SIZE`, from `--nproc-per-node`);
the dry run reads the same variable beside `WORLD_SIZE`. With one node (or unset) there is nothing to check.

Refused (a ConfigError naming the key):
* `parallelism.tp` whose groups cross nodes (tp not dividing the ranks per node). Tensor parallelism
  all-reduces or all-gathers activations in every layer, forward and backward, on the critical path with
  nothing to overlap: across nodes every layer waits on links several times slower than a node's. It is
  never what anyone wants, and another split (cp or pp across nodes) always exists.
* `parallelism.cp_alltoall_size` whose all-to-all blocks cross nodes. `alltoall_ring` exists to keep the
  all-to-all on a node's links and ring across nodes; a block that crosses nodes gives the slow half of both.
* Ranks per node that do not divide the world size: the nodes differ in size, and which dimensions a node
  holds differs between them. A node whose size matches the average cannot see it here; the ranks also
  compare their sizes once they meet (`cpcompose.training.loop.nodes`), before the trainer's collectives.

Warned (correct, only slower than it could be):
* `cp_strategy = "alltoall"` over a cp group that crosses nodes: every all-to-all waits on the links
  between nodes; `alltoall_ring` with blocks of a node's cp ranks is the same attention, exact either way.
* A dimension whose groups straddle node boundaries unevenly (cp = 3 on nodes of 4): its collectives run
  at the slowest link's speed, and the banner cannot say it is inside a node or across.
"""

from __future__ import annotations

import os

from cpcompose.config import ConfigError, JobConfig
from cpcompose.distributed import ParallelDims
from cpcompose.distributed.nodes import NodePlacement, place_on_nodes

__all__ = ["node_warnings", "placement", "ranks_per_node"]


def ranks_per_node(world: int) -> int:
    """The ranks of this node: `LOCAL_WORLD_SIZE` (torchrun, or set by hand for a dry run), else all of them."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else world


def placement(config: JobConfig, world: int) -> NodePlacement | None:
    """Where the mesh's dimensions land on this job's nodes; None on one node.

    Raises:
        ConfigError: the mesh does not fit the nodes (see the module's docstring), naming the key to change.
    """
    local = ranks_per_node(world)
    if local >= world:
        return None
    if world % local:
        raise ConfigError(
            f"torchrun --nproc-per-node: this node runs {local} ranks, which do not divide the world size "
            f"{world}: give every node the same --nproc-per-node (nodes of different sizes hold different "
            "parts of the mesh)")
    p = config.parallelism
    placed = place_on_nodes(ParallelDims.from_config(p, world), local)
    if local % p.tp:
        raise ConfigError(
            f"parallelism.tp: {p.tp} does not divide the {local} ranks of a node (torchrun --nproc-per-node), "
            "so tensor-parallel groups cross nodes, and every layer's all-reduce waits on the links between "
            f"them; choose a tp dividing {local} and split across nodes with cp, dp_shard or pp")
    a = p.cp_alltoall_size
    if p.cp_strategy == "alltoall_ring" and a is not None and local % (a * p.tp):
        fits = [d for d in range(1, p.cp + 1) if p.cp % d == 0 and (local // p.tp) % d == 0 and d > 1]
        raise ConfigError(
            f"parallelism.cp_alltoall_size: blocks of {a} cp ranks" + (f" x tp {p.tp}" if p.tp > 1 else "")
            + f" = {a * p.tp} ranks cross nodes of {local} ranks (torchrun --nproc-per-node), so the all-to-all "
            "that alltoall_ring keeps on a node's links crosses them; "
            + (f"choose {' or '.join(map(str, fits))}" if fits else "choose another cp_strategy"))
    return placed


def node_warnings(config: JobConfig, placed: NodePlacement | None) -> list[str]:
    """The banner's warnings for a mesh that fits the nodes but talks across them more than it needs to."""
    if placed is None:
        return []
    out = []
    p = config.parallelism
    cp = placed.of("cp")
    if p.cp_strategy == "alltoall" and cp is not None and cp.where != "inside":
        hint = (f"; cp_strategy = 'alltoall_ring' with cp_alltoall_size = {cp.per_node} keeps the all-to-all "
                "inside a node and rings across (the same attention, exact either way)"
                if cp.where == "split" else "")
        out.append(f"warning: parallelism.cp_strategy = 'alltoall' over cp = {p.cp} crosses nodes of "
                   f"{placed.ranks_per_node} ranks: every all-to-all waits on the links between nodes{hint}")
    for d in placed.dims:
        if d.where == "uneven":
            out.append(f"warning: parallelism.{d.name} = {d.size}: its groups straddle the boundaries of nodes of "
                       f"{placed.ranks_per_node} ranks unevenly, so its collectives run at the slowest link's "
                       "speed; degrees whose innermost product divides the ranks per node avoid it")
    return out

