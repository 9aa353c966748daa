"""Starting the ranks on this machine when the user did not use torchrun.

The launcher also owns what a job needs from its end (the ranks inherit its environment as it is:
glibc's own allocator settings unless the user set others, see `resources.ALLOCATOR_VARIABLES`):
- one failure message: ranks send their own one-line diagnosis here (a `Report`),
  which prints it; a line that is only a consequence of another rank's failure (a
  collective that lost its peer) waits until the end and is left out when another
  line explains the failure, and of several ranks out of memory only the first speaks. A rank that died without a word (killed) is reported
  here: as out of memory when the kernel's SIGKILL came while its resident set was
  near the budget or the host was nearly out of memory (the launcher reads its
  ranks' resident sets every `POLL_S`), else as killed. Ranks left waiting on a dead
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
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType
from typing import Callable

import torch

from cpcompose.config import JobConfig
from cpcompose.training.loop.checkpoint import MANIFEST, CheckpointManager
from cpcompose.training.errors import ErrorKind
from cpcompose.training.loop.metrics import stamp
from cpcompose.training.memory.oom import killed_line
from cpcompose.training.memory.resources import host_memory, resident_bytes

__all__ = ["GRACE_S", "INTERRUPTED_EXIT", "POLL_S", "Report", "launch_local",
           "planned_world_size", "saved_so_far"]

Report = Callable[[str, ErrorKind], None]
"""How a rank hands the launcher its one-line error: `report(line, kind)`."""

GRACE_S = 5.0  # after one rank failed, how long the others get to exit on their own
INTERRUPTED_EXIT = 128 + signal.SIGINT  # what shells report for a job ended by Ctrl-C
POLL_S = 0.1  # how often the launcher reads its ranks' resident sets


def planned_world_size(config: JobConfig) -> int:
    """The processes the degrees ask for (`dp_shard = -1` counts as 1)."""
    p = config.parallelism
    return p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp * p.pp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Reporter:
    """A rank's end of its pipe to the launcher (picklable, unlike a closure, for spawned ranks)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def __call__(self, line: str, kind: ErrorKind) -> None:
        self.conn.send((line, kind))


def _child(rank: int, world: int, port: int, fn: Callable[[JobConfig, Report], object], config: JobConfig,
           conn: Connection) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
    )
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # don't oversubscribe the cores
    fn(config, _Reporter(conn))


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


def launch_local(fn: Callable[[JobConfig, Report], object], config: JobConfig, world: int) -> int:
    """Run `fn(config, report)` on `world` local processes, as torchrun would; returns the job's exit code.

    `fn` reports its own errors through `report` and exits 1 (a failure it described) or 2
    (a config or environment error); any other non-zero exit is described here.
    """
    ctx = mp.get_context("spawn")
    port = _free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, config, pipes[r][1]), name=f"rank{r}")
             for r in range(world)]
    # Ctrl-C reaches every rank through the terminal; a SIGTERM sent to the launcher is passed on.
    # The ranks start with SIGINT ignored (inherited), until their trainer installs its handler.
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_term = signal.signal(signal.SIGTERM, lambda *_: [os.kill(p.pid, signal.SIGTERM) for p in procs if p.pid])
    try:
        for p in procs:
            p.start()
        for _, send in pipes:
            send.close()  # the ranks hold their ends: a dead rank's pipe reads as closed
        signal.signal(signal.SIGINT, _CtrlC(procs, config))
        return _Supervisor(procs, [recv for recv, _ in pipes], config, world).run()
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


@dataclass
class _Supervisor:
    """Waits for every rank, prints their lines, ends the rest once one failed, names an out-of-memory kill."""

    procs: list
    pipes: list[Connection]
    config: JobConfig
    world: int
    killed: set[int] = field(default_factory=set)  # ranks this launcher ended
    memory: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)  # last (rss, peak, avail, total)
    held: list[str] = field(default_factory=list)  # consequences, printed at the end if nothing explains them
    explained: bool = False
    out_of_memory: bool = False

    def run(self) -> int:
        deadline = None
        while running := [p for p in self.procs if p.exitcode is None]:  # a snapshot: waiting on none would block
            timeout = POLL_S if deadline is None else min(POLL_S, max(deadline - time.monotonic(), 0))
            wait([p.sentinel for p in running] + [c for c in self.pipes if not c.closed], timeout=timeout)
            self._read_lines()
            self._read_memory()
            for p in running:
                p.join(timeout=0)
            if deadline is None and any(p.exitcode not in (None, 0) for p in self.procs):
                deadline = time.monotonic() + GRACE_S
            if deadline is not None and time.monotonic() >= deadline:
                for r, p in enumerate(self.procs):
                    if p.exitcode is None:
                        self.killed.add(r)
                        p.kill()
                        p.join()
        self._read_lines()
        return self._finish([p.exitcode for p in self.procs])

    def _read_lines(self) -> None:
        for conn in self.pipes:
            while not conn.closed and conn.poll():
                try:
                    line, kind = conn.recv()
                except EOFError:
                    conn.close()
                    break
                if kind == "consequence":
                    self.held.append(line)
                elif kind == "error" or not self.out_of_memory:  # of several ranks out of memory, the first
                    self.out_of_memory |= kind == "oom"
                    self.explained = True
                    print(line, file=sys.stderr, flush=True)

    def _read_memory(self) -> None:
        total, available = host_memory()
        for r, p in enumerate(self.procs):
            if p.exitcode is None and p.pid and (now := resident_bytes(p.pid)) is not None:
                self.memory[r] = (now[0], now[1], available, total)

    def _finish(self, codes: list) -> int:
        if all(c == 0 for c in codes):
            return 0
        for r, code in enumerate(codes):
            if code == -signal.SIGKILL and r not in self.killed and r in self.memory and not self.out_of_memory:
                rss, peak, available, total = self.memory[r]
                line = killed_line(self.config, self.world, rank=r, peak=peak, resident=rss, available=available,
                                   total=total)
                if line is not None:
                    print(f"{stamp()} error: {line}", file=sys.stderr, flush=True)
                    self.explained = True
                    break
        if not self.explained:
            for line in self.held:
                print(line, file=sys.stderr, flush=True)
        if not self.explained and not self.held and not any(c in (1, 2) for c in codes):
            rank, code = next((r, c) for r, c in enumerate(codes) if c != 0)  # nobody explained: who died and how
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            print(f"rank {rank} {how}; the job stopped", file=sys.stderr, flush=True)
        return 2 if 2 in codes else 1
