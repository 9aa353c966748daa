"""Starting the ranks on this machine when the user did not use torchrun."""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch
import torch.multiprocessing as mp

from cpcompose.config import JobConfig


def planned_world_size(config: JobConfig) -> int:
    """The processes the degrees ask for (`dp_shard = -1` counts as 1)."""
    p = config.parallelism
    return p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp * p.pp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn: Callable[[JobConfig], object], config: JobConfig) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
    )
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # don't oversubscribe the cores
    fn(config)


def launch_local(fn: Callable[[JobConfig], object], config: JobConfig, world: int) -> None:
    """Run `fn(config)` on `world` local processes, as torchrun would; fail if any rank fails."""
    mp.start_processes(_child, args=(world, _free_port(), fn, config), nprocs=world, start_method="spawn")

