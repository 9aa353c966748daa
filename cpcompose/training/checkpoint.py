"""Resumable distributed checkpoints: model and optimizer through DCP, the rest beside them.

`torch.distributed.checkpoint` writes the model and optimizer as sharded state
keyed by parameter name, so a checkpoint saved at one parallel layout (say
dp_shard=2 x cp=2) loads into another (cp=4, or one process). The trainer state
(step, LR schedule, data position, RNG) is small and the same on every rank; rank 0
writes it next to the shards.

A save goes to `step-N.tmp/` and is renamed to `step-N/` only after every rank
has finished writing, so a crash mid-save never damages the last good checkpoint:
`latest()` ignores `.tmp` folders.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TRAINER_STATE = "trainer_state.pt"


class CheckpointManager:
    """Saves every `interval` steps into `folder`, keeping the newest `keep_latest_k`."""

    def __init__(self, folder: str | Path, *, interval: int, keep_latest_k: int) -> None:
        self.folder, self.interval, self.keep_latest_k = Path(folder), interval, keep_latest_k

    def due(self, step: int, *, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        steps = self._complete()
        return steps[-1][1] if steps else None

    def save(self, step: int, model: nn.Module, optimizer: Optimizer, trainer_state: dict[str, Any]) -> Path:
        """Write checkpoint `step` from every rank; returns its folder."""
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
        if rank == 0:
            torch.save(trainer_state, tmp / _TRAINER_STATE)
        dist.barrier()  # every shard is on disk before the checkpoint counts
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for _, old in self._complete()[: -self.keep_latest_k]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def load(self, path: Path, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        """Load `path` into the (already parallelized) model and optimizer; returns the trainer state."""
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return torch.load(path / _TRAINER_STATE, weights_only=False)

    def _complete(self) -> list[tuple[int, Path]]:
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _STEP_DIR.match(p.name))]
        return sorted(found)
