"""A sharded model written back as a folder `from_pretrained` loads: the source's names, dtypes and files.

Every rank writes its own slices with `torch.distributed.checkpoint`'s `HuggingFaceStorageWriter`, which
rank 0 then consolidates into ordinary safetensors files, one per file of the source checkpoint, so the
export holds the tensors exactly as the folder the model was loaded from did (experts one tensor each,
renamed and concatenated tensors under their stored names).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from cpcompose.comm import barrier
from cpcompose.integrations.transformers.weights.index import INDEX_FILE
from cpcompose.integrations.transformers.weights.plan import WeightPlan
from cpcompose.integrations.transformers.weights.shards import expert_pieces

__all__ = ["copy_model_files", "export_pretrained", "save_pretrained_weights"]


def save_pretrained_weights(model: nn.Module, folder: str | Path, plan: WeightPlan,
                            state: dict[str, Tensor] | None = None, held: WeightPlan | None = None) -> None:
    """Write `model`'s weights into `folder` as `plan`'s checkpoint stores them: the same names, dtypes and files.

    Every rank writes its slices (`HuggingFaceStorageWriter`, distributed), then rank 0 consolidates them
    into whole tensors, one file per file of the source checkpoint, with `model.safetensors.index.json`.
    A collective over the default group (every rank calls it); `folder` must be on storage every rank sees.
    `state`: the model's state as written (default `model.state_dict()`); expert-parallel blocks must come seen
    whole (`cpcompose.distributed.ExpertShards.view`), each rank's experts at their offset in the full tensor.
    `held`: the plan of the tensors this rank holds when ranks hold different ones (a pipeline rank's stages,
    `WeightPlan.of_names`); `plan` stays the whole model's, which names every file.
    """
    folder = Path(folder)
    state = model.state_dict() if state is None else state
    mine = plan if held is None else held
    out: dict[str, Tensor] = {stored: state[name] for name, stored in mine.direct.items()}
    out.update(expert_pieces(mine, state))
    pieces: dict[str, list[tuple[int, Tensor]]] = {}  # stored name -> (first row, rows) from each model tensor
    for name, concat in mine.concatenated.items():  # small tensors (convs, projections): gathered, in plan order
        tensor = state[name].full_tensor() if isinstance(state[name], DTensor) else state[name]
        for part, start, rows in zip(concat.parts, concat.starts, tensor.split(list(concat.rows), dim=0)):
            pieces.setdefault(part, []).append((start, rows))
    out.update({part: torch.cat([rows for _, rows in sorted(found, key=lambda x: x[0])]) if len(found) > 1
                else found[0][1] for part, found in pieces.items()})
    out = {k: v.detach().to(plan.stored[k].dtype) for k, v in out.items()}
    names = plan.stored_names()  # every rank's: the writer's coordinator maps all of them to files
    files = sorted({plan.stored[k].file for k in names})
    mapping = {k: files.index(plan.stored[k].file) + 1 for k in names}
    writer = dcp.HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=mapping, save_distributed=True,
                                          enable_consolidation=True)
    dcp.save(out, storage_writer=writer)
    if _is_rank0():
        shutil.rmtree(folder / "sharded", ignore_errors=True)  # the per-rank files, consolidated now
    _barrier()


def copy_model_files(source: str | Path, folder: str | Path) -> list[str]:
    """Copy `source`'s files other than weights and config.json (tokenizer, chat template, generation config)."""
    weights = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
    copied = []
    for path in sorted(Path(source).iterdir()):
        if path.is_file() and path.name not in ("config.json", INDEX_FILE) and not path.name.endswith(weights):
            shutil.copy2(path, Path(folder) / path.name)
            copied.append(path.name)
    return copied


def export_pretrained(model: nn.Module, folder: str | Path, *, source: str | Path, config: PretrainedConfig,
                      plan: WeightPlan, state: dict[str, Tensor] | None = None, held: WeightPlan | None = None) -> None:
    """Write a folder `from_pretrained` loads: `model`'s weights as `source` stores them, `config`, `source`'s
    tokenizer and other files. A collective (see `save_pretrained_weights`); rank 0 writes the small files.

    Args:
        model: the (sharded or whole) model whose weights to write.
        folder: created if missing.
        source: the folder the model was loaded from (names, dtypes and files of the weights; tokenizer files).
        config: the model's config as it was trained (with any context-extension overrides).
        plan: `weight_plan(model, source)` (the whole model's, under expert parallelism too).
        state, held: as `save_pretrained_weights` takes them.
    """
    folder = Path(folder)
    rank0 = _is_rank0()
    if rank0:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in list(folder.glob("*.safetensors")) + [folder / INDEX_FILE]:  # an earlier export's files
            stale.unlink(missing_ok=True)
    _barrier()
    save_pretrained_weights(model, folder, plan, state, held)
    if rank0:
        copy_model_files(source, folder)
        config = copy.deepcopy(config)
        floats = [t.dtype for t in plan.stored.values() if t.dtype.is_floating_point]
        if floats:  # the dtype the weights are written in (from_config may have changed the config's own)
            config.dtype = max(set(floats), key=floats.count)
        config.save_pretrained(folder)
    _barrier()


def _is_rank0() -> bool:
    """Whether this process writes the files one writer makes (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    """Wait for every rank (when there are several): what one rank wrote is there for all after it."""
    if dist.is_initialized():
        barrier()
