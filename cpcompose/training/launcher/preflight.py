"""Checks made in the launching process, before any rank starts.

Every problem found here would otherwise surface after the ranks started, as one
long traceback per rank (or, for an unwritable folder, at the first save). Each
check raises a ConfigError whose one-line message names the key to change.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from cpcompose.config import ConfigError, JobConfig
from cpcompose.data.loader import build_token_stores
from cpcompose.training.memory.budget import check_memory
from cpcompose.training.memory.resources import run_device_type
from cpcompose.training.loop.checkpoint import CheckpointManager, earlier_run_message, saved_step, verify
from cpcompose.training.families import family_of
from cpcompose.training.launcher.nodes import placement, ranks_per_node
from cpcompose.training.resolve import resolve_config
from cpcompose.training.loop.run_lock import LOCK_NAME, holder

__all__ = ["preflight"]


def preflight(config: JobConfig, world: int, *, data_notes: Callable[[str], None] | None = None) -> str | None:
    """Check the device, the model's files, the data (its token stores built), the memory plan and the dump folder,
    of a config the resolution step has resolved (`cpcompose.training.resolve.resolve_config`).

    Args:
        data_notes: given each line the launch banner shows about what the data check did (each token store
            reused, with its folder, built, or rebuilt and why).
    Returns:
        A message when there is nothing to train (the checkpoint already reached
        `training.steps`), so the caller can stop without starting ranks; else None.
    Raises:
        ConfigError: naming the key to change.
    """
    config = resolve_config(config, world)  # resolved by the launcher already: the same config (idempotent)
    _check_device(config, world)
    placement(config, world)  # a mesh that does not fit the nodes (torchrun's LOCAL_WORLD_SIZE ranks each)
    family_of(config).check(config)
    for note in _build_token_stores(config, world):
        if data_notes is not None:
            data_notes(note)
    check_memory(config, world)
    return _check_dump_folder(config, world)


def _check_device(config: JobConfig, world: int) -> None:
    if config.training.device == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(f"training.device: 'cuda' requested but {why}; set --training.device=cpu (or auto)")
    local = ranks_per_node(world)  # each rank takes GPU LOCAL_RANK: a node needs one per rank
    if run_device_type(config) == "cuda" and local > (gpus := torch.cuda.device_count()):
        raise ConfigError(f"torchrun --nproc-per-node: {local} ranks on this node but {gpus} GPU(s) visible (each "
                          f"rank takes GPU LOCAL_RANK); run at most {gpus} ranks a node (torchrun --nproc-per-node, "
                          "or smaller degrees), or --training.device=cpu")


def _build_token_stores(config: JobConfig, world: int) -> list[str]:
    """The tokenizer, the vocabulary and the files: their token stores built here, before any rank starts (in
    memory: every record of a small corpus, a sample of a large one; the ranks check the rest as they load).
    Returns what the check did, for the banner (`cpcompose.data.build_token_stores`)."""
    return build_token_stores(config)


def _check_dump_folder(config: JobConfig, world: int) -> str | None:
    dump = Path(config.job.dump_folder)
    try:
        dump.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=dump, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"job.dump_folder: cannot write to {dump} ({e.strerror}); choose another folder") from None
    # With several nodes only rank 0's host can tell a crashed job's lock from a live one, and a refusal on some
    # nodes only would leave the others waiting to meet: rank 0 takes the lock and tells every rank (the trainer).
    if ranks_per_node(world) >= world and (info := holder(dump)) is not None:
        raise ConfigError(
            f"job.dump_folder: {dump} is in use by another job (pid {info.get('pid')} on {info.get('host')}); "
            f"choose another folder, or delete {dump / LOCK_NAME} if that job is gone"
        )
    c = config.checkpoint
    if not c.enable:
        return None
    manager = CheckpointManager(dump / c.folder, interval=c.interval, keep_latest_k=c.keep_latest_k)
    existing = manager.complete()
    if existing and not c.resume:
        raise ConfigError(f"checkpoint.resume: {earlier_run_message(manager.folder, existing)}")
    for _, path in reversed(existing):
        if verify(path) is None:
            step = saved_step(path)
            if step >= config.training.steps and config.checkpoint.export_hf is None:  # else: resume, export
                return (f"nothing to train: {path} is already at step {step} of training.steps = "
                        f"{config.training.steps}; raise --training.steps, or start fresh in another "
                        "--job.dump_folder")
            return None
    return None
