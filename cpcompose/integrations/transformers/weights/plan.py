"""Where each of a model's state tensors is stored in a checkpoint folder, planned before any weight is read.

The plan is made from the safetensors headers and the model's own tensors (a model on the meta device
will do), so that a mismatch is one error naming the tensors, raised before any rank reads or collects
anything. Most tensors are stored under their names or a renamed one (`renaming.py`); tied tensors are
stored once and loaded through their first name; the rest are transformers' converted tensors
(`converted.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from torch import nn

from cpcompose.integrations.transformers.weights.converted import ConcatenatedRows, StackedExperts, find_converted
from cpcompose.integrations.transformers.weights.index import StoredTensor, read_checkpoint_index
from cpcompose.integrations.transformers.weights.renaming import stored_name, transformers_conversions

__all__ = ["WeightPlan", "weight_plan"]


@dataclass(frozen=True)
class WeightPlan:
    """Where each of a model's state tensors is stored in a checkpoint folder."""

    direct: dict[str, str] = field(default_factory=dict)
    """model name -> stored name (the same, or renamed)."""
    stacked: dict[str, StackedExperts] = field(default_factory=dict)
    """model name -> its per-expert stored tensors."""
    tied: dict[str, str] = field(default_factory=dict)
    """model name -> the model name it shares its tensor with (loaded and saved through that one)."""
    concatenated: dict[str, ConcatenatedRows] = field(default_factory=dict)
    """model name -> the stored tensors it is the concatenation of along dim 0."""
    stored: dict[str, StoredTensor] = field(default_factory=dict)
    """What the folder holds (the headers)."""

    def stored_names(self) -> list[str]:
        """Every stored tensor the plan reads (and an export writes), in the model's order."""
        names = list(self.direct.values())
        for stack in self.stacked.values():
            names += [key for e in range(len(stack.parts[0])) for part in stack.parts for key in (part[e],)]
        for stack in self.concatenated.values():
            names += [p for p in stack.parts if p not in names]  # a split tensor's parts share one stored tensor
        return names

    def of_names(self, names: set[str]) -> WeightPlan:
        """The plan of the same model with only the state tensors `names` held (a pipeline rank's stages: the
        layers, embedding and head of the other stages dropped); what the folder holds is unchanged."""
        return replace(self, direct={k: v for k, v in self.direct.items() if k in names},
                       stacked={k: v for k, v in self.stacked.items() if k in names},
                       tied={k: v for k, v in self.tied.items() if k in names},
                       concatenated={k: v for k, v in self.concatenated.items() if k in names})

    def of_expert_blocks(self, blocks: dict[str, tuple[int, int]]) -> WeightPlan:
        """The plan of the same model with some stacked-experts tensors held in part: `blocks` maps a model name to
        (first expert, count), the rows `[first, first + count)` of the full tensor (an expert-parallel rank's
        block). A tensor stored stacked becomes a range of its stored rows (read like a split tensor, no
        collective); one stored per expert keeps the block's experts only. Its rows along dim 0 (FSDP's shard of
        the block, if any) then index into that range.

        Raises:
            ValueError: a name the plan does not hold as stacked experts (or stored whole), or a block past the
                stored experts.
        """
        direct, stacked, concatenated = dict(self.direct), dict(self.stacked), dict(self.concatenated)
        for name, (first, count) in blocks.items():
            if name in direct:
                key = direct.pop(name)
                total = self.stored[key].shape[0]
                if not 0 <= first < first + count <= total:
                    raise ValueError(f"{name}: experts [{first}, {first + count}) of the {total} stored in {key}")
                concatenated[name] = ConcatenatedRows((key,), (first,), (count,))
            elif name in stacked:
                stack = stacked[name]
                if not 0 <= first < first + count <= len(stack.parts[0]):
                    raise ValueError(f"{name}: experts [{first}, {first + count}) of the {len(stack.parts[0])} "
                                     "stored one by one")
                stacked[name] = replace(stack, parts=tuple(part[first:first + count] for part in stack.parts))
            else:
                raise ValueError(f"{name}: not a stacked-experts tensor of the plan (tied, concatenated or unknown)")
        return replace(self, direct=direct, stacked=stacked, concatenated=concatenated)


def weight_plan(model: nn.Module, folder: str | Path) -> WeightPlan:
    """Where each of `model`'s state tensors (parameters and persistent buffers) is stored in `folder`.

    Works on a model on the meta device (shapes only); reads the safetensors headers, no weights.

    Raises:
        ValueError: tensors the plan cannot find, or found with another shape (the first few named), or a
            folder with no readable safetensors.
    """
    stored = read_checkpoint_index(folder)
    renames, converters = transformers_conversions(model)
    state = model.state_dict(keep_vars=True)
    owner: dict[int, str] = {}  # one name per distinct tensor: the first that is stored, else the first
    for name, tensor in state.items():
        if id(tensor) not in owner or (owner[id(tensor)] not in stored and name in stored):
            owner[id(tensor)] = name
    plan = WeightPlan(stored=stored)
    problems = []
    for name, tensor in state.items():
        first = owner[id(tensor)]
        if first != name:
            plan.tied[name] = first
            continue
        shape = tuple(tensor.shape)
        key = stored_name(name, stored, renames)
        if key is not None:
            if stored[key].shape != shape:
                problems.append(f"{key}: stored with shape {stored[key].shape}, the model's is {shape}")
            plan.direct[name] = key
            continue
        found = find_converted(name, state, stored, renames, converters)
        if isinstance(found, ConcatenatedRows):
            plan.concatenated[name] = found
        elif isinstance(found, StackedExperts):
            plan.stacked[name] = found
        else:
            problems.append(f"{name}: " + (found or "not in the checkpoint"))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"{Path(folder)} does not hold {type(model).__name__}'s weights as it expects: "
                         + "; ".join(problems[:5]) + more)
    return plan
