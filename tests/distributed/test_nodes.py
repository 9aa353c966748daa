"""Where torchrun's nodes of consecutive ranks put each mesh dimension: inside, across, split or uneven."""

from __future__ import annotations

import pytest

from cpcompose.distributed import ParallelDims
from cpcompose.distributed.nodes import place_on_nodes


@pytest.mark.parametrize("degrees, per_node, line", [
    # (dp_replicate, dp_shard, cp, tp, pp), ranks per node
    ((1, 2, 2, 1, 1), 2, "nodes: 2 x 2 ranks; inside a node: cp 2 (2 ranks); across nodes: dp_shard 2"),
    ((1, 2, 2, 2, 1), 4, "nodes: 2 x 4 ranks; inside a node: tp 2 x cp 2 (4 ranks); across nodes: dp_shard 2"),
    ((1, 4, 16, 1, 1), 8, "nodes: 8 x 8 ranks; inside a node: cp 8 of 16 (8 ranks); "
                          "across nodes: cp 16 = 8 per node x 2 nodes, dp_shard 4"),
    ((2, 4, 2, 2, 2), 8, "nodes: 8 x 8 ranks; inside a node: tp 2 x cp 2 x dp_shard 2 of 4 (8 ranks); "
                         "across nodes: dp_shard 4 = 2 per node x 2 nodes, dp_replicate 2, pp 2"),
    ((1, 4, 3, 1, 1), 4, "nodes: 3 x 4 ranks; inside a node: nothing; across nodes: nothing; "
                         "straddling node boundaries unevenly: cp 3, dp_shard 4"),
])
def test_the_innermost_dimensions_fill_a_node_first(degrees, per_node: int, line: str) -> None:
    """tp, then cp, then dp_shard fill a node; what does not fit crosses nodes (torchtitan's mesh order)."""
    dp_replicate, dp_shard, cp, tp, pp = degrees
    world = dp_replicate * dp_shard * cp * tp * pp
    placed = place_on_nodes(ParallelDims(dp_replicate, dp_shard, cp, tp, pp, world), per_node)
    assert placed.line() == line
    # the definition, rank by rank: a dimension is inside a node when each of its groups is on one node
    for d in placed.dims:
        groups = {}
        for r in range(world):
            base = r - (r // d.stride % d.size) * d.stride
            groups.setdefault(base, set()).add(r // per_node)
        assert (d.where == "inside") == all(len(nodes) == 1 for nodes in groups.values()), d
        assert (d.where == "across") == all(len(nodes) == d.size for nodes in groups.values()), d


def test_nodes_of_different_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="3 ranks per node do not divide the world size 4"):
        place_on_nodes(ParallelDims(1, 2, 2, 1, 1, 4), 3)
