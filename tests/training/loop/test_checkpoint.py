"""Nothing lost, nothing silently wrong: the trainer's checkpoints belong to one run and are verified.

Each case runs the real trainer (tiny Llama, a few steps) on every rank of a forked
gloo pool, as tests/training/loop/test_trainer.py does, and returns what the test checks, so an
expected `TrainingError` comes back as its message instead of tearing the pool down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from cpcompose.config import load_config
from cpcompose.training.loop.checkpoint import MANIFEST, TRAINER_STATE, CheckpointManager, verify
from cpcompose.training.loop.run_lock import LOCK_NAME, RunLock
from cpcompose.training.loop.trainer import Trainer
from tests.support.trainer import TINY, run

CKPT = ["--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=3", "--parallelism.cp=2"]


def test_fresh_run_refuses_another_runs_checkpoints(pools, tmp_path: Path) -> None:
    """resume=false in a folder with checkpoints used to train and let rotation delete the new ones."""
    dump = [f"--job.dump_folder={tmp_path}"]
    assert run(pools, CKPT + dump + ["--training.steps=4"])["error"] is None
    got = run(pools, CKPT + dump + ["--training.steps=2", "--checkpoint.resume=false"])
    assert str(tmp_path / "checkpoint") in got["error"] and "--checkpoint.resume=true" in got["error"]
    assert "--job.dump_folder" in got["error"]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2", "step-4"]
    assert not (tmp_path / LOCK_NAME).exists(), "the lock is released after a refusal"


def save_tiny(mesh, folder: str, step: int, keep: int) -> list[str]:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(folder, interval=1, keep_latest_k=keep)
    manager.save(step, model, optimizer, {"step": step})
    return sorted(p.name for p in Path(folder).iterdir())


def test_rotation_never_deletes_the_checkpoint_just_written(pools, tmp_path: Path) -> None:
    """Higher step numbers already present (another run's, or a skipped one) used to win the rotation."""
    for step in (100, 200):
        (tmp_path / f"step-{step}").mkdir()
    assert "step-5" in pools.get(1).run(save_tiny, str(tmp_path), 5, 2)[0]
    assert pools.get(1).run(save_tiny, str(tmp_path), 6, 2)[0] == ["step-100", "step-200", "step-5", "step-6"]
    assert pools.get(1).run(save_tiny, str(tmp_path), 7, 2)[0] == ["step-100", "step-200", "step-6", "step-7"]


def test_a_live_lock_refuses_and_a_stale_lock_is_taken_over(pools, tmp_path: Path) -> None:
    """Two jobs in one folder used to rotate and resume each other's checkpoints."""
    holder = RunLock(tmp_path)
    holder.acquire()  # this pytest process: alive
    try:
        got = run(pools, CKPT + [f"--job.dump_folder={tmp_path}", "--training.steps=2"])
        assert "in use by another job" in got["error"] and str(os.getpid()) in got["error"]
    finally:
        holder.release()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": os.uname().nodename, "pid": int(dead.stdout)}))
    assert run(pools, CKPT + [f"--job.dump_folder={tmp_path}", "--training.steps=2"])["error"] is None
    assert not (tmp_path / LOCK_NAME).exists()


def test_non_finite_loss_stops_without_saving(pools, tmp_path: Path) -> None:
    """lr=1e30 blows the weights up after step 1: stop at step 2, keep step-1, write nothing after."""
    got = run(pools, CKPT + [f"--job.dump_folder={tmp_path}", "--training.steps=6", "--checkpoint.interval=1",
                             "--optimizer.lr=1e30", "--lr_scheduler.warmup_steps=0"])
    assert got["error"] is not None and "step 2:" in got["error"] and "not finite" in got["error"]
    assert "step-1" in got["error"]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]
    assert verify(tmp_path / "checkpoint" / "step-1") is None


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_resume_skips_corrupt_and_empty_checkpoints(pools, tmp_path: Path) -> None:
    """A byte flipped inside a tensor used to load silently; an empty step folder was trusted."""
    dump = [f"--job.dump_folder={tmp_path}", "--metrics.plot_loss=true"]
    full = run(pools, CKPT + dump + ["--training.steps=4"])["losses"]
    ckpt = tmp_path / "checkpoint"
    _flip_byte(next(ckpt.glob("step-4/__0_0.distcp")))
    (ckpt / "step-9").mkdir()  # empty: must not be trusted
    (ckpt / "step-7.tmp").mkdir()  # a save that crashed: cleaned at start
    assert "checksum" in verify(ckpt / "step-4") and MANIFEST in verify(ckpt / "step-9")
    resumed = run(pools, CKPT + dump + ["--training.steps=6"])["losses"]
    assert len(resumed) == 4, "resumed from step-2, the newest intact checkpoint"
    assert resumed[:2] == full[2:4], "and reproduced steps 3-4 bit-exactly"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["step-2", "step-4", "step-4.corrupt", "step-6", "step-9.corrupt"], names
    history = torch.load(ckpt / "step-6" / TRAINER_STATE, weights_only=False)["loss_history"]
    assert [s for s, _ in history] == [1, 2, 3, 4, 5, 6], "the loss history (and plot) spans the whole run"


def test_all_checkpoints_corrupt_is_an_error(pools, tmp_path: Path) -> None:
    (tmp_path / "checkpoint" / "step-3").mkdir(parents=True)
    got = run(pools, CKPT + [f"--job.dump_folder={tmp_path}", "--training.steps=4"])
    assert "no intact checkpoint" in got["error"] and "step-3" in got["error"]


def stop_on_one_rank(mesh, args: list[str]) -> dict:
    """Only rank 1 gets SIGTERM (a real signal, from a timer thread) while training."""
    import signal
    import threading

    trainer = Trainer(load_config(TINY + args))
    if torch.distributed.get_rank() == 1:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    losses = trainer.run()
    return {"steps": len(losses), "handler_restored": signal.getsignal(signal.SIGTERM) != trainer._on_signal}


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(pools, tmp_path: Path) -> None:
    """Ranks agree through a tiny all-reduce at each step boundary, so they save the same step."""
    got = pools.get(2).run(stop_on_one_rank, CKPT + [f"--job.dump_folder={tmp_path}", "--training.steps=100000",
                                                     "--checkpoint.interval=100000"])
    assert got[0] == got[1] and got[0]["handler_restored"], got
    steps = got[0]["steps"]
    assert 0 < steps < 100000
    assert verify(tmp_path / "checkpoint" / f"step-{steps}") is None
