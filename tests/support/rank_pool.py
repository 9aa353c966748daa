"""Real multi-process gloo groups for tests, started once per group size.

Starting a process group costs 3-9 s with torchrun or spawn on these machines, but
forking workers from the pytest process (which has already imported torch) costs
well under a second. So a `RankPool` forks P workers once, each joins a gloo group
with a timeout, and then runs many test cases sent over pipes: a case is a
module-level function `fn(mesh, *args)` run on every rank. Nothing about the
communication is mocked. A case that raises on any rank tears the pool down (the
group may be mid-collective) and the next case gets a fresh one.

`device="cuda"` pools run the same cases on GPUs: each worker takes GPU
`rank % device_count`, and the group is NCCL when there are at least P GPUs, else
gloo (P processes sharing one GPU; cpcompose's comm helpers then stage CUDA tensors
through host memory). Their workers are *spawned*, not forked: a child forked from
a process whose CUDA driver is initialized cannot use CUDA, and on the first GPU
run every CUDA pool after the first failed that way ("CUDA error: initialization
error") although the test process never called torch's lazy CUDA init. Spawned
workers start clean, whatever the pytest process has loaded; they cost a few
seconds each (importing torch), once per pool. Workers return results on the CPU.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import sys
import tempfile
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable, Literal

import torch

Device = Literal["cpu", "cuda"]

THREAD_LIMIT = 150
"""A worker with more threads than this is replaced before its next case. The cases' process groups and meshes
(gloo: three threads each) outlive them in a worker, and some of their loop threads keep running: a 2-rank pool
whose workers had gathered 1,556 threads each had 15 of them runnable at once late in the suite, where a fresh
worker has ~20, and every test then ran several times slower than alone."""
GROUP_TIMEOUT_S = 60.0  # a collective waiting longer than this fails instead of hanging CI
CASE_TIMEOUT_S = 300.0  # the parent gives up on a case after this long


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _on_host(obj: Any) -> Any:
    """`obj` with every tensor (in dicts, lists, tuples) moved to the CPU, for the parent to load."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_host(v) for v in obj)
    return obj


def cuda_backend(world: int) -> str:
    """NCCL when every rank has a GPU of its own; gloo when ranks share (NCCL refuses shared GPUs)."""
    return "nccl" if torch.cuda.device_count() >= world else "gloo"


def _worker(rank: int, world: int, store: str, conn: Connection, device: Device) -> None:
    import faulthandler

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    log_dir = os.environ.get("CPCOMPOSE_WORKER_LOGS")  # one stderr file per worker, where ranks interleave
    log = open(os.path.join(log_dir, f"P{world}-{device}-rank{rank}-{os.getpid()}.log"), "w") if log_dir else None
    # a crash (segfault in a kernel or a backend) prints its Python stack; the process's own stderr, since a
    # pool forked inside a test that captures sys.stderr (capsys) inherits a stream with no file descriptor
    faulthandler.enable(log or sys.__stderr__)
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = cuda_backend(world)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("cp",))
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            result = fn(mesh, *args)
            conn.send(("ok", _dumps(result if device == "cpu" else _on_host(result))))
        except BaseException:  # report everything, the parent decides
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """`world` workers (forked on CPU, spawned on CUDA) in one process group; `run` executes a case on all."""

    def __init__(self, world: int, device: Device = "cpu") -> None:
        self.world, self.device = world, device
        ctx = mp.get_context("fork" if device == "cpu" else "spawn")
        fd, self._store = tempfile.mkstemp(prefix="cpcompose-store-")
        os.close(fd)
        os.unlink(self._store)
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world, self._store, child, device), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for conn in self._conns:
            self._receive(conn, GROUP_TIMEOUT_S)
        self.healthy = True

    def _receive(self, conn: Connection, timeout: float) -> tuple[str, Any]:
        if not conn.poll(timeout):
            self.close()
            raise TimeoutError(
                f"a rank of the {self.world}-rank {self.device} pool did not answer within {timeout:.0f} s"
            )
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            raise self._died() from e

    def _died(self) -> RuntimeError:
        """A worker is gone (crashed, killed): close the pool so the next case gets a fresh one."""
        for proc in self._procs:
            proc.join(timeout=5)
        codes = [proc.exitcode for proc in self._procs]
        self.close()
        return RuntimeError(f"a worker of the {self.world}-rank {self.device} pool died (exit codes by rank: {codes})")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = CASE_TIMEOUT_S) -> list[Any]:
        """Run `fn(mesh, *args)` on every rank; return the per-rank results.

        Raises:
            AssertionError: with every failing rank's traceback.
        """
        for conn in self._conns:
            try:
                conn.send((fn, args))
            except OSError as e:  # BrokenPipeError: a worker died after the last case
                raise self._died() from e
        replies = [self._receive(conn, timeout) for conn in self._conns]
        failures = [f"--- rank {r} ---\n{payload}" for r, (kind, payload) in enumerate(replies) if kind != "ok"]
        if failures:
            self.close()
            raise AssertionError("case failed on a rank:\n" + "\n".join(failures))
        return [_loads(payload) for _, payload in replies]

    def threads(self) -> int:
        """The most threads any worker runs now (0 where /proc cannot say)."""
        most = 0
        for proc in self._procs:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    most = max(most, next((int(line.split()[1]) for line in f if line.startswith("Threads:")), 0))
            except OSError:
                pass
        return most

    def close(self) -> None:
        self.healthy = False
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        if os.path.exists(self._store):
            os.unlink(self._store)


class PoolCache:
    """One healthy pool per group size and device, created on first use."""

    def __init__(self) -> None:
        self._pools: dict[tuple[int, Device], RankPool] = {}

    def get(self, world: int, device: Device = "cpu") -> RankPool:
        pool = self._pools.get((world, device))
        if pool is not None and pool.healthy and pool.threads() > THREAD_LIMIT:
            pool.close()  # a fresh pool, before leftover groups' threads slow every case (THREAD_LIMIT)
        if pool is None or not pool.healthy:
            pool = self._pools[world, device] = RankPool(world, device)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
