"""Nothing hung, clean exits, preemption: the real launcher (`python -m cpcompose.train`) under faults.

Each run starts real rank processes with real gloo groups; a fault is injected by
`CPCOMPOSE_FAULT` (read by the trainer at a step boundary). Runs are started
concurrently (they mostly wait) to keep the file near a minute.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

from cpcompose.training.loop.checkpoint import verify
from tests.support.trainer import TINY

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 4.0
SHORT = [a for a in TINY if not a.startswith(("--training.steps", "--metrics.log_freq"))] + [
    "--metrics.log_freq=1", "--parallelism.cp=2", f"--comm.timeout_s={TIMEOUT_S}",
]


@dataclass
class Job:
    """A launcher process whose output lines are timestamped as they arrive."""

    proc: subprocess.Popen
    lines: list[tuple[float, str]] = field(default_factory=list)
    err: list[str] = field(default_factory=list)

    def first(self, pattern: str) -> float | None:
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    @property
    def stdout(self) -> str:
        return "".join(line for _, line in self.lines)

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def start(args: list[str], fault: str | None = None) -> Job:
    """Start the launcher in its own session, so that a test can signal (or kill) it with its ranks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CPCOMPOSE_FAULT", None)
    if fault:
        env["CPCOMPOSE_FAULT"] = fault
    proc = subprocess.Popen([sys.executable, "-m", "cpcompose.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    job = Job(proc)
    stamp_lines = lambda: [job.lines.append((time.monotonic(), ln)) for ln in proc.stdout]  # noqa: E731
    threading.Thread(target=stamp_lines, daemon=True).start()
    threading.Thread(target=lambda: [job.err.append(ln) for ln in proc.stderr], daemon=True).start()
    return job


def finish(job: Job, timeout: float = 240) -> float:
    """Wait for the launcher; returns when it ended (monotonic). A launcher that hangs is killed, and fails."""
    try:
        job.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.proc.pid, signal.SIGKILL)  # the launcher and its ranks (own session)
        job.proc.wait()
        raise AssertionError(f"the launcher hung for {timeout} s:\n{job.stdout[-2000:]}\n{job.stderr[-2000:]}")
    ended = time.monotonic()
    time.sleep(0.2)  # let the reader threads drain
    return ended


def _forked_rank(rank: int, store: str, args: list[str], fault: str, conn) -> None:
    """A trainer rank forked from pytest (no torch import to pay), with the fault in its environment."""
    import torch
    import torch.distributed as dist

    from cpcompose.config import load_config
    from cpcompose.training.errors import TrainingError
    from cpcompose.training.loop.trainer import Trainer

    torch.set_num_threads(1)
    os.environ["CPCOMPOSE_FAULT"] = fault
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    dist.group.WORLD.set_timeout(timedelta(seconds=TIMEOUT_S))  # as cpcompose.train does
    try:
        Trainer(load_config(args)).run()
        conn.send((time.monotonic(), "finished"))
    except TrainingError as e:
        conn.send((time.monotonic(), f"error: {e}"))
    except BaseException as e:  # noqa: BLE001 - anything else is reported as such, and fails the test
        conn.send((time.monotonic(), f"unexpected {type(e).__name__}: {e}"))
    conn.close()
    os._exit(0)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
@pytest.mark.parametrize("kind", ["stall", "die"])
def test_a_stalled_or_dead_rank_is_named_within_the_timeout(tmp_path: Path, kind: str, strategy: str) -> None:
    """Rank 1 stalls (or is killed) before step 2; rank 0 reports it within comm.timeout_s + 10 s.

    Ring used to wait for the init timeout (600 s here: 60 s) in its point-to-point
    receives; a dead peer gave a raw gloo error.
    """
    ctx = mp.get_context("fork")
    args = SHORT + ["--training.steps=4", f"--parallelism.cp_strategy={strategy}", f"--job.dump_folder={tmp_path}"]
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_forked_rank, args=(r, str(tmp_path / "store"), args, f"{kind}:rank=1:step=2",
                                                   pipes[r][1]), daemon=True) for r in range(2)]
    started = time.monotonic()
    for p in procs:
        p.start()
    try:
        assert pipes[0][0].poll(TIMEOUT_S + 50), "rank 0 did not finish: hung"  # 50 s for start-up and step 1
        ended, message = pipes[0][0].recv()
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert message.startswith("error: rank 0: training failed at step 2: rank 1 "), message
    assert ("stopped responding" if kind == "stall" else "died") in message, message
    assert ended - started < TIMEOUT_S + 10 + 20, f"{ended - started:.1f} s"  # 20 s: start-up and step 1


def _ring_receiver(rank: int, store: str, explicit: float | None, conn) -> None:
    """Rank 0 posts a ring receive that rank 1 never answers; reports how long the wait took."""
    import torch
    import torch.distributed as dist

    from cpcompose.comm import CPGroup, RingComm

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # created with a long timeout ...
    dist.group.WORLD.set_timeout(timedelta(seconds=2))  # ... then set short, as the trainer does
    if rank == 1:
        time.sleep(30)  # stalled: never sends
        os._exit(0)
    cp = CPGroup(dist.group.WORLD, 0, 2, None if explicit is None else timedelta(seconds=explicit))
    start = time.monotonic()
    pending = RingComm(cp).exchange_with([], dst=1, recv_like=[torch.zeros(4)], src=1)
    try:
        pending.wait()
        conn.send(("returned", time.monotonic() - start))
    except RuntimeError as e:
        conn.send((str(e), time.monotonic() - start))
    os._exit(0)


@pytest.mark.parametrize("explicit", [None, 1.0])
def test_ring_receive_waits_honour_the_timeout(tmp_path: Path, explicit: float | None) -> None:
    """gloo's point-to-point waits used the timeout the group was created with, ignoring set_timeout."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_ring_receiver, args=(r, str(tmp_path / "store"), explicit, send), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert recv.poll(25), "the receive still waits: its timeout was not applied"
        message, waited = recv.recv()
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert "timed out" in message.lower() or "timeout" in message.lower(), message
    assert waited < (explicit or 2.0) + 3, f"waited {waited:.1f} s"


def test_the_launcher_ends_every_rank_with_one_message(tmp_path: Path) -> None:
    """The real launcher: the stalled rank is ended too, the dead one is named, no traceback."""
    jobs = {kind: start(SHORT + ["--training.steps=4", f"--job.dump_folder={tmp_path / kind}"],
                        f"{kind}:rank=1:step=2") for kind in ("stall", "die")}
    for kind, job in jobs.items():
        ended = finish(job)
        step1 = job.first(r"step +1/4")
        assert step1 is not None, job.stdout + job.stderr
        assert job.proc.returncode == 1, (kind, job.stderr)
        assert ended - step1 < TIMEOUT_S + 10, f"{kind}: {ended - step1:.1f} s after step 1"
        errors = [ln for ln in job.err if "error:" in ln]
        assert len(errors) == 1 and "Traceback" not in job.stderr, (kind, job.stderr)
        assert "rank 1 " in errors[0] and "step 2" in errors[0], (kind, errors[0])


def test_successful_runs_always_exit_zero(tmp_path: Path) -> None:
    """Runs used to abort at interpreter exit now and then ('terminate called without an active exception')."""
    outputs = ["--metrics.enable_tensorboard=true", "--metrics.plot_loss=true"]
    jobs = [start(SHORT + outputs + ["--training.steps=2", f"--job.dump_folder={tmp_path / str(i)}"])
            for i in range(3)]  # at once: they overlap their start-up, and their exits race each other
    for job in jobs:
        finish(job)
        assert job.proc.returncode == 0, job.stderr[-3000:]
        assert "terminate called" not in job.stderr
    out = jobs[0].stdout
    assert "parameters" in out and "outputs:" in out and "tokens per step" in out, out  # the banner
    assert re.search(r"^\d\d:\d\d:\d\d step +2/2", out, re.M), out  # timestamps
    done = [ln for ln in out.splitlines() if " done: " in ln][0]
    assert "loss.png" in done and "tensorboard" in done, done


def test_preemption_saves_at_the_next_step_boundary(tmp_path: Path) -> None:
    """SIGTERM (to the launcher) and Ctrl-C (SIGINT to the whole process group) used to save nothing.

    Both runs go at once; each must save a verified checkpoint, say why it stopped and exit 0.
    """
    def args(name: str) -> list[str]:
        return SHORT + ["--training.steps=100000", "--checkpoint.enable=true", "--checkpoint.interval=100000",
                        f"--job.dump_folder={tmp_path / name}"]

    jobs = {sig: start(args(sig.name)) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig, job in jobs.items():
        deadline = time.monotonic() + 120
        while job.first(r"step +3/") is None and time.monotonic() < deadline and job.proc.poll() is None:
            time.sleep(0.1)
        assert job.first(r"step +3/") is not None, job.stderr
        if sig == signal.SIGINT:
            os.killpg(job.proc.pid, sig)  # what a terminal does on Ctrl-C
        else:
            job.proc.send_signal(sig)
    for sig, job in jobs.items():
        finish(job, timeout=60)
        assert job.proc.returncode == 0, job.stderr[-3000:]
        saved = re.search(r"saved checkpoint step-(\d+) \([\d.]+ MiB, [\d.]+ s\)", job.stdout)
        assert saved and f"stopped by {sig.name}" in job.stdout, job.stdout[-2000:]
        assert verify(tmp_path / sig.name / "checkpoint" / f"step-{saved.group(1)}") is None
