"""Expert-parallel blocks seen whole, so that a checkpoint or an export writes every expert once.

Under expert parallelism each EP rank holds a contiguous block of `E / ep` experts of every stacked experts tensor,
under the full tensor's own name (`mlp.experts.gate_up_proj`), and FSDP chunks that block over the experts' mesh
`efsdp` axis. Written as they are, the EP ranks would write different tensors under one name. `ExpertShards.view`
shows each such tensor, and its optimizer state, as a DTensor of all `E` experts on the experts' mesh
(dp_replicate, efsdp, ep), placed [Replicate, _StridedShard(0, split_factor=ep), Shard(0)]: split into `ep` blocks
first, each block then chunked over `efsdp` exactly as FSDP chunks it (`torch.chunk`, uneven chunks too). The view
shares the local tensors' storage and runs no collective; DCP places each rank's rows by their offsets in the
whole tensor, so a checkpoint saved at one ep loads at another (ep = 1 holds the same names: transformers' own
experts module, FSDP-sharded like any tensor), and an export writes each expert from a rank that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from cpcompose import _compat
from cpcompose.distributed.parallel_dims import EXPERT_MESH_DIM_NAMES

__all__ = ["ExpertShards"]


@dataclass(frozen=True)
class ExpertShards:
    """Which state tensors are expert-parallel blocks (qualified names), and the experts' mesh they are split on
    (`ParallelDims.build_expert_mesh`: axes dp_replicate, efsdp, ep)."""

    mesh: DeviceMesh
    names: frozenset[str]

    def __post_init__(self) -> None:
        if self.mesh.mesh_dim_names != EXPERT_MESH_DIM_NAMES:  # the placements below name its axes in this order
            raise ValueError(f"ExpertShards: a mesh with axes {self.mesh.mesh_dim_names}; pass the experts' mesh "
                             f"{EXPERT_MESH_DIM_NAMES} (ParallelDims.build_expert_mesh)")

    def whole(self, tensor: Tensor) -> DTensor:
        """This rank's block of an experts tensor (FSDP's DTensor over efsdp, or a plain tensor) as a DTensor of all
        the experts, sharing its storage."""
        local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
        ep = self.mesh["ep"].size()
        shape = torch.Size((tensor.shape[0] * ep, *tensor.shape[1:]))  # a DTensor's shape is the block's
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.mesh, (Replicate(), _compat.strided_shard(0, ep), Shard(0)),
                                  run_check=False, shape=shape, stride=stride)

    def view(self, model_state: dict[str, Any], optim_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """`{"model": ..., "optimizer": ...}` (`get_state_dict`'s two) with every expert tensor seen whole: the
        parameters, and their optimizer state of the same shape (Adam's moments); scalars (`step`) as they are.

        Raises:
            ValueError: an expert parameter's optimizer state holds a tensor of another shape, which this view
                cannot place.
        """
        model = {k: self.whole(v) if k in self.names else v for k, v in model_state.items()}
        if optim_state is None:
            return {"model": model}
        per_param = dict(optim_state["state"])
        for name in self.names & per_param.keys():
            entry = dict(per_param[name])
            for key, value in entry.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    if value.shape != model_state[name].shape:
                        raise ValueError(f"optimizer state {name}.{key} has shape {tuple(value.shape)}, its expert "
                                         f"parameter {tuple(model_state[name].shape)}")
                    entry[key] = self.whole(value)
            per_param[name] = entry
        return {"model": model, "optimizer": {**optim_state, "state": per_param}}
