"""Which stored tensors, and which rows of them, a rank's shard of a model tensor holds.

FSDP shards every tensor along dim 0. For a stacked-experts tensor that dim is the expert, so each rank
holds whole experts and reads and writes those experts' stored tensors only; a concatenated tensor's
local rows map to row ranges of its stored parts. Loading and saving both go through these two views.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor
from torch.distributed.tensor import DTensor

from cpcompose.integrations.transformers.weights.plan import WeightPlan

__all__ = ["expert_pieces", "local_rows"]


def local_rows(tensor: Tensor) -> tuple[int, Tensor]:
    """(global index of the first row (expert) this rank holds, its local rows) of a model tensor sharded on dim 0.

    Dim 0 may be split by several mesh axes (Shard(0), or the `_StridedShard(0)` of expert-parallel blocks seen
    whole, `ExpertShards`) as long as each rank's rows are one range.

    Raises:
        ValueError: a DTensor sharded on another dim, which would split an expert between ranks.
    """
    if not isinstance(tensor, DTensor):
        return 0, tensor
    if not all(p.is_replicate() or getattr(p, "dim", None) == 0 for p in tensor.placements):
        raise ValueError(f"a stacked-experts tensor sharded as {tensor.placements}: only dim 0 (FSDP's default) "
                         "keeps each expert whole on one rank")
    chunks = tensor.__create_chunk_list__()  # the local shard's offset in the global tensor (as DCP reads it)
    return int(chunks[0].offsets[0]) if chunks else 0, tensor.to_local()


def expert_pieces(plan: WeightPlan, state: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """(stored name, view into this rank's shard) of every expert tensor this rank holds."""
    for name, stack in plan.stacked.items():
        first, local = local_rows(state[name])
        for i in range(local.shape[0]):
            start = 0
            for part, rows in zip(stack.parts, stack.rows):
                yield part[first + i], local[i].narrow(0, start, rows)
                start += rows
