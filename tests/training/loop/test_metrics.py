"""The peak memory a run logs is its own, whatever process started it.

Linux keeps `getrusage`'s `ru_maxrss` across `exec`, so a trainer started from a large
parent (here: this test holding 1.5 GiB; in CI, pytest after most of the suite) logged
the parent's resident set at the fork as its own peak: the memory plan's real-run tests
passed alone and failed in the full suite, measured 960 MiB against a plan of 450.
`VmHWM` is kept per address space, new at `exec`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.support.trainer import TINY

ROOT = Path(__file__).resolve().parents[3]
BALLAST_MIB = 1536


def test_logged_peak_is_not_the_parents(tmp_path: Path) -> None:
    ballast = torch.ones(BALLAST_MIB * 2**20 // 4)  # touched: resident in this process
    args = TINY + ["--training.steps=2", "--metrics.log_freq=1", f"--job.dump_folder={tmp_path}"]
    result = subprocess.run([sys.executable, "-m", "cpcompose.train", *args], capture_output=True, text=True,
                            cwd=ROOT, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    peaks = [float(x.replace(",", "")) for x in re.findall(r"peak ([\d,]+) MiB", result.stdout)]
    assert peaks, result.stdout[-2000:]
    # A tiny model's rank holds torch and a few MiB of tensors: a few hundred MiB, far below the ballast.
    assert 0 < max(peaks) < BALLAST_MIB / 2, (max(peaks), result.stdout[-1000:])
    assert float(ballast[-1]) == 1.0  # alive until the child has run
