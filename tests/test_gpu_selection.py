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
TARGET = "tests/training/test_trainer.py"  # two gpu tests among CPU ones


def _collect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", TARGET, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )


def test_gpu_marker_selection() -> None:
    plain, only_gpu = _collect(), _collect("-m", "gpu")
    if cuda_device_count() == 0:
        assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:]
        assert "(2 deselected)" in plain.stdout and "test_cuda_" not in plain.stdout
        assert only_gpu.returncode == 4, only_gpu.stdout[-2000:]
        assert NO_CUDA in only_gpu.stdout + only_gpu.stderr
    else:
        assert plain.returncode == 0 and "test_cuda_cp2_follows_cp1" in plain.stdout
        assert only_gpu.returncode == 0 and re.search(r"\b2/\d+ tests collected", only_gpu.stdout)
