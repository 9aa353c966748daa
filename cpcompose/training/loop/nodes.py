"""What the ranks of several nodes must agree on once they meet, before the trainer's first collective.

Two facts no process can check alone before launch:

* Every node runs the same number of ranks. The pre-launch check (`launcher.nodes`) sees only its own
  node's `LOCAL_WORLD_SIZE`; a node whose size happens to equal the average cannot tell. Nodes of different
  sizes hold different parts of the mesh, so what the banner says a node holds would be false on some.
* With checkpoints on, `job.dump_folder` is one folder for the whole job (a filesystem every node mounts).
  Each rank writes its own shards of a checkpoint and rank 0 seals it (`checkpoint.py`): on per-node disks
  the seal would count only node 0's shards, and the run would fail only when it resumes.

Both are settled with three small collectives on the world group (gather, broadcast, gather), so every
rank raises the same error, naming the option to change, before the mesh is built.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections import Counter
from pathlib import Path

import torch.distributed as dist

from cpcompose.comm import all_gather_objects, broadcast_object
from cpcompose.config import JobConfig
from cpcompose.training.errors import TrainingError

__all__ = ["agree_on_nodes", "node_size_error"]

Seat = tuple[int, str, str]
"""One rank's (LOCAL_WORLD_SIZE, GROUP_RANK (its node), host name)."""


def node_size_error(seats: list[Seat]) -> str | None:
    """The error when the nodes run different numbers of ranks (`seats` in rank order), else None."""
    counts = Counter(node for _, node, _ in seats)
    told = {local for local, _, _ in seats}
    if len(set(counts.values())) == 1 and told == {next(iter(counts.values()))}:
        return None
    sizes = ", ".join(f"node {node}: {n}" for node, n in sorted(counts.items()))
    return (f"torchrun --nproc-per-node: the nodes run different numbers of ranks ({sizes}): give every node the "
            "same --nproc-per-node, so that every node holds the same part of the mesh")


def agree_on_nodes(config: JobConfig) -> None:
    """Collective on the world group: the nodes' sizes, and (several nodes, checkpoints on) one shared dump folder.

    Raises:
        TrainingError: exit code 2, the same line on every rank.
    """
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or world
    seats = all_gather_objects((local, os.environ.get("GROUP_RANK", "0"), socket.gethostname()))
    error = node_size_error(seats)
    if error is None and local < world and config.checkpoint.enable:
        error = _shared_folder_error(Path(config.job.dump_folder), seats)
    if error is not None:
        raise TrainingError(error, exit_code=2)


def _shared_folder_error(dump: Path, seats: list[Seat]) -> str | None:
    """Rank 0 writes a file in the dump folder; every rank looks for it; the ranks that cannot see it are named."""
    rank = dist.get_rank()
    marker = None
    if rank == 0:
        marker = dump / f".cpcompose-shared-{secrets.token_hex(8)}"
        marker.write_text("written by rank 0 to check that every node sees this folder\n")
    # After the write, so the file exists now; rank 0's folder names it in the error on every rank.
    folder, name = broadcast_object(None if marker is None else (str(dump), marker.name))
    seen = all_gather_objects((dump / name).is_file())
    if marker is not None:
        marker.unlink(missing_ok=True)
    blind = sorted({f"{seats[r][1]} ({seats[r][2]})" for r, ok in enumerate(seen) if not ok})
    if not blind:
        return None
    return (f"job.dump_folder: {folder} is not one folder for the whole job: node(s) {', '.join(blind)} do not see "
            "the file rank 0 wrote there, so each node's checkpoint shards would land on its own disk; put "
            "job.dump_folder on a filesystem every node mounts, or set --checkpoint.enable=false")
