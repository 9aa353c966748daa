"""A checkpoint folder read into a model's (sharded or whole) tensors, each rank reading only its own slices.

`torch.distributed.checkpoint` with its `HuggingFaceStorageReader` reads only the bytes of the slices
asked for, so no rank ever holds the whole model: the plan names the stored tensor (or expert piece)
behind each local tensor, and the few concatenated tensors read their rows straight from safetensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import Tensor, nn

from cpcompose.integrations.transformers.weights.plan import WeightPlan, weight_plan
from cpcompose.integrations.transformers.weights.shards import expert_pieces, local_rows

__all__ = ["load_pretrained_weights"]


def load_pretrained_weights(model: nn.Module, folder: str | Path, plan: WeightPlan | None = None) -> WeightPlan:
    """Read `model`'s weights from `folder` into its (sharded or whole) tensors, in place.

    A collective over the default group when the model's tensors are DTensors (every rank calls it);
    each rank reads only the slices it holds, cast to its tensors' dtype. Tied tensors are tied again
    first: `to_empty` on a model without FSDP gives each module its own new tensor.

    Returns:
        The plan used.
    Raises:
        ValueError: what `weight_plan` raises.
    """
    plan = plan or weight_plan(model, folder)
    _retie(model, plan)
    state = model.state_dict()
    wanted: dict[str, Tensor] = {stored: state[name] for name, stored in plan.direct.items()}
    wanted.update(expert_pieces(plan, state))
    dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
    _load_concatenated(plan, state, Path(folder))
    return plan


def _load_concatenated(plan: WeightPlan, state: dict[str, Tensor], folder: Path) -> None:
    """Each concatenated tensor's local rows, read from the slices of its stored parts they cover (no collective)."""
    for name, concat in plan.concatenated.items():
        first, local = local_rows(state[name])
        with torch.no_grad():
            for key, row, rows, at in concat.pieces(first, local.shape[0]):
                with safe_open(str(folder / plan.stored[key].file), framework="pt") as f:
                    local.narrow(0, at, rows).copy_(f.get_slice(key)[row:row + rows])


def _retie(model: nn.Module, plan: WeightPlan) -> None:
    """Point every tied parameter at its twin again (FSDP's `to_empty` keeps ties; `nn.Module.to_empty` does not)."""
    for name, twin in plan.tied.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        shared = model.get_parameter(twin)
        if attr in owner._parameters and owner._parameters[attr] is not shared:
            setattr(owner, attr, shared)
