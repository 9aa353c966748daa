"""Starting the ranks on this machine when the user did not use torchrun.

The launcher also owns what a job needs from its environment and its end:
- glibc's allocator settings for CPU training (set before the ranks start, since
  glibc reads them once at process start), unless the user set them;
- one failure message: ranks print their own one-line diagnosis; a rank that
  died without a word (killed) is reported here, and ranks left waiting on a dead
  or failed peer are ended after a short grace instead of hanging the job;
- Ctrl-C and SIGTERM reach the ranks, which save at the next step boundary. The
  launcher says so at the first Ctrl-C (a step can take minutes, and a silent
  terminal invites a second press); a second Ctrl-C ends every rank at once and
  says what a restart will find: the newest checkpoint, or none.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path
from types import FrameType
from typing import Callable

import torch

from cpcompose.config import JobConfig
from cpcompose.training.checkpoint import MANIFEST, CheckpointManager
from cpcompose.training.metrics import stamp

__all__ = ["CPU_ALLOCATOR_ENV", "GRACE_S", "INTERRUPTED_EXIT", "launch_local", "planned_world_size", "saved_so_far"]

# A high mmap threshold keeps large tensors in the heap instead of mapping and unmapping
# them every step; a high trim threshold keeps freed memory for the next step. Measured here:
# one step 5.4 s -> 2.2 s (README, "A note for CPU training").
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
GRACE_S = 5.0  # after one rank failed, how long the others get to exit on their own
INTERRUPTED_EXIT = 128 + signal.SIGINT  # what shells report for a job ended by Ctrl-C


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


def saved_so_far(config: JobConfig) -> str:
    """What a restart of the same command would start from, said for a run that just ended early.

    Reads only folder names and the manifest's presence (no checksums: this runs at a
    Ctrl-C, and checkpoints can be large); the restart verifies before it resumes.
    """
    if not config.checkpoint.enable:
        return "nothing was saved (checkpoint.enable = false): the same command starts again from step 0"
    c = config.checkpoint
    folder = Path(config.job.dump_folder) / c.folder
    manager = CheckpointManager(folder, interval=c.interval, keep_latest_k=c.keep_latest_k)
    sealed = [(step, path) for step, path in manager.complete() if (path / MANIFEST).is_file()]
    if not sealed:
        return f"nothing was saved (no checkpoint in {folder}): the same command starts again from step 0"
    step, path = sealed[-1]
    return f"the newest checkpoint is {path}: the same command resumes from step {step}"


class _CtrlC:
    """The launcher's SIGINT handler: the first says what will happen, the second ends every rank now.

    The ranks get each Ctrl-C from the terminal too: the first makes them stop and save
    at the next step boundary (their own handler). The second is taken here, not left to
    each rank, so that the job ends in one piece with one message: a rank that dies of
    its own second signal would leave its peers to report a dead peer first.
    """

    def __init__(self, procs: list, config: JobConfig) -> None:
        self.procs, self.config, self.count = procs, config, 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1:
            what = ("finishes this step, saves a checkpoint and stops" if self.config.checkpoint.enable
                    else "finishes this step and stops (checkpoint.enable = false: nothing is saved)")
            print(f"{stamp()} Ctrl-C: every rank {what}; press Ctrl-C again to stop at once, without saving",
                  flush=True)
            return
        for p in self.procs:
            if p.exitcode is None and p.pid:
                p.kill()
        for p in self.procs:
            p.join()
        print(f"{stamp()} stopped at once by a second Ctrl-C, without saving the step in progress; "
              f"{saved_so_far(self.config)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(INTERRUPTED_EXIT)  # nothing else to wait for; skip the supervisor's account of the kills


def launch_local(fn: Callable[[JobConfig], object], config: JobConfig, world: int) -> int:
    """Run `fn(config)` on `world` local processes, as torchrun would; returns the job's exit code.

    `fn` reports its own errors and exits 1 (a failure it described) or 2 (a config or
    environment error); any other non-zero exit is described here.
    """
    if config.training.device != "cuda":
        for key, value in CPU_ALLOCATOR_ENV.items():
            os.environ.setdefault(key, value)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, config), name=f"rank{r}") for r in range(world)]
    # Ctrl-C reaches every rank through the terminal; a SIGTERM sent to the launcher is passed on.
    # The ranks start with SIGINT ignored (inherited), until their trainer installs its handler.
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_term = signal.signal(signal.SIGTERM, lambda *_: [os.kill(p.pid, signal.SIGTERM) for p in procs if p.pid])
    try:
        for p in procs:
            p.start()
        signal.signal(signal.SIGINT, _CtrlC(procs, config))
        return _supervise(procs)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def _supervise(procs: list) -> int:
    """Wait for every rank; once one fails, end the rest after GRACE_S; returns the exit code."""
    deadline = None
    while running := [p for p in procs if p.exitcode is None]:  # one snapshot: waiting on none would block
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0)
        wait([p.sentinel for p in running], timeout=timeout)
        for p in running:
            p.join(timeout=0)
        if deadline is None and any(p.exitcode not in (None, 0) for p in procs):
            deadline = time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() >= deadline:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                    p.join()
    codes = [p.exitcode for p in procs]
    if all(c == 0 for c in codes):
        return 0
    if not any(c in (1, 2) for c in codes):  # nobody explained: say who died and how
        rank, code = next((r, c) for r, c in enumerate(codes) if c != 0)
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        print(f"rank {rank} {how}; the job stopped", file=sys.stderr, flush=True)
    return 2 if 2 in codes else 1
