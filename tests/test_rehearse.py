"""`python -m cpcompose.rehearse` (the `cpcompose-rehearse` command): its own `--world`, the trainer's options after
it, and the rehearsal's lines (tests/training/test_rehearsal.py checks the numbers against the plan).

In a fresh interpreter, as a user runs it: the rehearsal's fake process group must be the process's only one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "train_configs/debug_cpu.toml", "--training.seq_len=256"]  # the main job: seconds


def _rehearse(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cpcompose.rehearse", *argv], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300, check=False)


def test_the_command_rehearses_a_tiny_config_and_prints_the_tracker_beside_the_plan() -> None:
    done = _rehearse("--world", "2", *TINY)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("rehearsed ") and " on 2 ranks in " in lines[0], lines
    assert lines[1].startswith("  rehearsal on 2 fake ranks: torch's FSDPMemTracker peak "), lines
    assert lines[-1].startswith("  memory plan (tensors"), lines


def test_the_world_is_required() -> None:
    done = _rehearse(*TINY)
    assert done.returncode == 2 and "--world" in done.stderr, done.stderr
