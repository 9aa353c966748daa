"""How many CUDA devices the `gpu` tests can use, asked without initializing CUDA here.

tests/conftest.py deselects the `gpu` tests when this is 0; tests/test_gpu_selection.py
checks that selection.
"""

from __future__ import annotations

import subprocess
import sys

import torch

NO_CUDA = "no CUDA device"


def cuda_device_count() -> int:
    """GPUs visible to torch, counted without initializing CUDA in this process.

    Counting through torch here could initialize CUDA in the pytest process, which the
    forked CPU pools would then inherit; a CUDA build asks a short-lived subprocess.
    """
    if not torch.backends.cuda.is_built():
        return 0
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
        return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return 0
