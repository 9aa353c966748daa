"""The `gpu` marker: deselected without CUDA (never skipped-and-green), an error when asked for without it.

Runs pytest's collection in a subprocess on a file with two gpu tests. Both branches
assert: without a CUDA device the gpu tests are reported as deselected and `-m gpu`
fails with "no CUDA device"; with one they are collected and `-m gpu` selects them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.gpu import NO_CUDA, cuda_device_count

ROOT = Path(__file__).parents[1]
TARGET = "tests/training/loop/test_trainer.py"  # two gpu tests among CPU ones


def _collect(*variants: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """pytest's collection with each variant's arguments, side by side (each is mostly torch's import)."""
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", TARGET, *args], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in variants]
    done = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(run.args, run.returncode, out, err))
    return done


def test_gpu_marker_selection() -> None:
    plain, only_gpu = _collect((), ("-m", "gpu"))
    if cuda_device_count() == 0:
        assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:]
        assert "(2 deselected)" in plain.stdout and "test_cuda_" not in plain.stdout
        assert only_gpu.returncode == 4, only_gpu.stdout[-2000:]
        assert NO_CUDA in only_gpu.stdout + only_gpu.stderr
    else:
        assert plain.returncode == 0 and "test_cuda_cp2_follows_cp1" in plain.stdout
        assert only_gpu.returncode == 0 and re.search(r"\b2/\d+ tests collected", only_gpu.stdout)
