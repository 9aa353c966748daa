"""Resumable distributed checkpoints: model and optimizer through DCP, the rest beside them.

`torch.distributed.checkpoint` writes the model and optimizer as sharded state
keyed by parameter name, so a checkpoint saved at one parallel layout (say
dp_shard=2 x cp=2) loads into another (cp=4, or one process). Expert-parallel
blocks (each EP rank its own experts under the whole tensor's name) are written
seen whole (`ExpertShards.view`), so they too load at another ep, or at ep = 1.
The trainer state (step, LR schedule, data position, RNG, loss history) is small
and the same on every rank; rank 0 writes it next to the shards.

What keeps a checkpoint from being lost or silently wrong:
- A save goes to `step-N.tmp/` and is renamed to `step-N/` only after every rank
  has finished writing, so a crash mid-save never damages the last good
  checkpoint; stale `.tmp` folders are removed when the next run starts.
- Rank 0 then writes `manifest.json` (size and SHA-256 of every file) last; a
  folder without one, with a file of another size or checksum, or whose DCP
  metadata does not read, is not trusted: resume falls back to the newest intact
  checkpoint and says which it skipped and why.
- Rotation keeps the newest `keep_latest_k`, always counting the one just written.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from cpcompose.comm import barrier, broadcast
from cpcompose.distributed import ExpertShards
from cpcompose.training.errors import TrainingError

__all__ = [
    "MANIFEST", "TRAINER_STATE", "CheckpointManager", "SavedCheckpoint", "earlier_run_message", "saved_step",
    "verify", "write_manifest",
]

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")
TRAINER_STATE = "trainer_state.pt"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a save produced, for the log line."""

    path: Path
    bytes: int
    seconds: float


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> int:
    """Record size and checksum of every file in `folder`; returns the total size in bytes."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=1))
    return sum(f["bytes"] for f in files.values())


def verify(folder: Path) -> str | None:
    """Why checkpoint `folder` cannot be trusted, or None when it is intact."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (an incomplete save, or not written by cpcompose)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name in (TRAINER_STATE, ".metadata"):
        if name not in files:
            return f"{MANIFEST} does not list {name}"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {entry['bytes']} were written"
        if _sha256(path) != entry["sha256"]:
            return f"{name} does not match its checksum (corrupted on disk)"
    try:
        dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure means the folder is unusable
        return f"DCP metadata does not load ({type(e).__name__}: {e})"
    return None


def saved_step(folder: Path) -> int:
    """The step recorded in checkpoint `folder` (reads only the small trainer state)."""
    return int(torch.load(folder / TRAINER_STATE, weights_only=False)["step"])


def earlier_run_message(folder: Path, existing: list[tuple[int, Path]]) -> str:
    """Why a fresh run (checkpoint.resume = false) may not use a folder holding checkpoints."""
    return (
        f"{folder} already holds checkpoints of an earlier run ({', '.join(p.name for _, p in existing)}); "
        "continue it with --checkpoint.resume=true, or start a new run with another --job.dump_folder "
        "(or delete that folder)"
    )


class CheckpointManager:
    """Saves every `interval` steps into `folder`, keeping the newest `keep_latest_k` (0: all); `experts`: the
    model's expert-parallel blocks (None without expert parallelism)."""

    def __init__(self, folder: str | Path, *, interval: int, keep_latest_k: int,
                 experts: ExpertShards | None = None) -> None:
        self.folder, self.interval, self.keep_latest_k = Path(folder), interval, keep_latest_k
        self.experts = experts

    def _written(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> dict[str, Any]:
        """What DCP writes and reads: the two state dicts, expert blocks seen whole (sharing their storage)."""
        if self.experts is None:
            return {"model": model_state, "optimizer": optim_state}
        return self.experts.view(model_state, optim_state)

    def due(self, step: int, *, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def complete(self) -> list[tuple[int, Path]]:
        """Every `step-N` folder, oldest first (intact or not)."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _STEP_DIR.match(p.name))]
        return sorted(found)

    def newest_on_disk(self) -> Path | None:
        """The newest `step-N` folder (not verified: for messages)."""
        found = self.complete()
        return found[-1][1] if found else None

    def remove_stale_tmp(self) -> list[Path]:
        """Delete `step-N.tmp` folders left by a save that crashed (call while holding the run lock)."""
        stale = [p for p in self.folder.iterdir() if _TMP_DIR.match(p.name)] if self.folder.is_dir() else []
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        return stale

    def newest_intact(self) -> tuple[Path | None, list[str]]:
        """The newest checkpoint that verifies, and one line per newer one skipped (with the reason).

        A skipped folder is renamed `step-N.corrupt` (kept for inspection) so that neither a
        later resume nor rotation counts it. Call on rank 0 while holding the run lock.
        """
        skipped = []
        for step, path in reversed(self.complete()):
            reason = verify(path)
            if reason is None:
                return path, skipped
            aside = path.with_name(f"{path.name}.corrupt")
            shutil.rmtree(aside, ignore_errors=True)
            path.rename(aside)
            skipped.append(f"skipped checkpoint {path}: {reason} (moved to {aside.name})")
        return None, skipped

    def choose_resume(self, *, enable: bool, resume: bool) -> tuple[Path | None, list[str]]:
        """Rank 0, holding the run lock: clean stale saves, then the checkpoint to resume (or None).

        Returns the path and the lines to print (stale folders removed, corrupt ones skipped).

        Raises:
            TrainingError: a fresh run in a folder with checkpoints, or no intact checkpoint left.
        """
        notes = [f"removed {p} (a save that did not finish)" for p in self.remove_stale_tmp()]
        existing = self.complete() if enable else []
        if existing and not resume:
            raise TrainingError(earlier_run_message(self.folder, existing))
        if not existing:
            return None, notes
        path, skipped = self.newest_intact()
        if path is None:
            raise TrainingError(f"no intact checkpoint in {self.folder} ({'; '.join(skipped)}); "
                                "start a new run with another --job.dump_folder")
        return path, notes + skipped

    def save(self, step: int, model: nn.Module, optimizer: Optimizer, trainer_state: dict[str, Any]) -> SavedCheckpoint:
        """Write checkpoint `step` from every rank (collective); returns its folder, size and time."""
        start = time.perf_counter()
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        dcp.save(self._written(*get_state_dict(model, optimizer)), checkpoint_id=str(tmp))
        if rank == 0:
            torch.save(trainer_state, tmp / TRAINER_STATE)
        barrier()  # every shard is on disk before the checkpoint counts
        size = torch.zeros((), dtype=torch.float64)
        if rank == 0:
            size += write_manifest(tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self._rotate(keep=final)
        broadcast(size, src=0)
        return SavedCheckpoint(final, int(size.item()), time.perf_counter() - start)

    def _rotate(self, keep: Path) -> None:
        """Delete the oldest beyond keep_latest_k; `keep` (just written) always stays, newer ones too."""
        if self.keep_latest_k == 0:
            return
        step = int(_STEP_DIR.match(keep.name).group(1))
        others = [p for s, p in self.complete() if s < step]
        for old in others[: max(len(others) - (self.keep_latest_k - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        """Load `path` into the (already parallelized) model and optimizer; returns the trainer state."""
        model_state, optim_state = get_state_dict(model, optimizer)
        state = self._written(model_state, optim_state)
        dcp.load(state, checkpoint_id=str(path))  # tensors in place (a view's storage is its block's)
        if self.experts is not None:  # values DCP replaces rather than fills (none for AdamW) went to the view's dicts
            for name in self.experts.names & optim_state["state"].keys():
                optim_state["state"][name].update({k: v for k, v in state["optimizer"]["state"][name].items()
                                                   if not isinstance(v, torch.Tensor)})
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        return torch.load(path / TRAINER_STATE, weights_only=False)
