"""A rank's own size beside its tensors, measured on this machine rather than assumed.

The memory plan adds the process itself (interpreter, torch's libraries, the communication
group, the kernels' workspaces) to what its tensors hold. That size depends on the torch
build more than on anything else: measured here, a rank after its first step holds 335 MiB
with torch 2.13.0's CPU wheel and 709 MiB with 2.14.1's default CUDA wheel (run on the CPU);
transformers adds 55 to 90 MiB. A constant fitted to one build is 25-50% under the peak of a
small run on another. So on the CPU the plan asks a fresh interpreter: it imports what a rank
imports, joins a one-rank gloo group, runs a tiny training step through the kernels a step
touches (linear layers, SDPA, bfloat16 autocast, AdamW) in the rank's thread count, and
reports its resident peak. About 3 s (5 s with transformers), so the figure is kept in cpcompose's per-user
cache (`process-footprint.json`, beside the token stores), keyed by everything it depends on: the interpreter,
the torch, transformers and cpcompose versions and the modules. A later start reads it. It is measured on one
thread: a rank's intra-op threads add well under 1 MiB (352.03 against 352.10 MB at one and two threads here).

A GPU's own share (the CUDA context, cuBLAS workspaces, NCCL buffers) cannot be measured
before a rank holds the device: `CUDA_PROCESS_BYTES` is a round figure.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from cpcompose.data.store.cache import cpcompose_cache_folder
from cpcompose.data.store.lock import flock_by

__all__ = ["CUDA_PROCESS_BYTES", "FALLBACK_CPU_PROCESS_BYTES", "process_bytes"]

CUDA_PROCESS_BYTES = 2**30
"""A rank's own share of GPU memory, which `max_memory_allocated` does not count: a round figure, not measured."""
FALLBACK_CPU_PROCESS_BYTES = 330 * 2**20
"""Used only where the measurement cannot run (no /proc, or the measuring interpreter failed): the size measured
with torch 2.13.0's CPU wheel."""
_TIMEOUT_S = 180.0
_MARK = "cpcompose-footprint-bytes="
_CACHE_FILE = "process-footprint.json"


@functools.cache
def process_bytes(device_type: str, imports: tuple[str, ...] = ()) -> int:
    """A rank's own size beside its tensors, bytes.

    Args:
        device_type: "cpu" (measured) or "cuda" (`CUDA_PROCESS_BYTES`).
        imports: the modules a rank imports beyond the trainer's (a family's integration).

    Where the measuring interpreter fails, the plan says so on stderr and uses `FALLBACK_CPU_PROCESS_BYTES`.
    """
    if device_type == "cuda":
        return CUDA_PROCESS_BYTES
    if not os.path.exists("/proc/self/status"):
        return FALLBACK_CPU_PROCESS_BYTES
    key = _cache_key(imports)
    cached = _read_cache().get(key)
    if isinstance(cached, int) and cached > 0:
        return cached
    with _one_measurer():  # the ranks of a torchrun job all plan at once: one measures, the others read its figure
        cached = _read_cache().get(key)
        if isinstance(cached, int) and cached > 0:
            return cached
        measured = _measure_in_a_fresh_interpreter(imports)
        _write_cache(key, measured)
    return measured


@contextlib.contextmanager
def _one_measurer() -> Iterator[None]:
    """Hold an exclusive `flock` on the cache folder itself (no lock file to leave behind) while measuring.

    Waits at most the measurement's own timeout; past it, or where the folder cannot be made or locked, this
    process measures anyway (the figure is the same, only the time is spent twice)."""
    path = _cache_path()
    fd = None
    try:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path.parent, os.O_RDONLY)
            flock_by(fd, time.monotonic() + _TIMEOUT_S)  # not taken in time: measured anyway
    except OSError:
        pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _versions() -> str:
    found = []
    for name in ("torch", "transformers", "cpcompose"):
        try:
            found.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name}=none")
    return " ".join(found)


def _cache_key(imports: tuple[str, ...]) -> str:
    return f"{os.path.realpath(sys.executable)} {_versions()} imports={','.join(imports)}"


def _cache_path() -> Path | None:
    root = cpcompose_cache_folder()
    return None if root is None else root / _CACHE_FILE


def _read_cache() -> dict:
    path = _cache_path()
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):  # none yet, unreadable, or half written by a crashed writer: measured again
        return {}


def _write_cache(key: str, measured: int) -> None:
    """Add `key` to the cache file (written whole to a temporary file and renamed: readers see old or new)."""
    path = _cache_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = {**_read_cache(), key: measured}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{_CACHE_FILE}.", delete=False) as f:
            json.dump(entries, f, indent=1)
        os.replace(f.name, path)
    except OSError:  # a read-only home: measured again next time
        pass


def _measure_in_a_fresh_interpreter(imports: tuple[str, ...]) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)  # a one-rank group of its own, not the job's
    try:
        done = subprocess.run([sys.executable, "-m", __name__, *imports], env=env,
                              capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return _fallback(str(e))
    found = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if done.returncode != 0 or not found:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
        return _fallback(f"exit {done.returncode}: {tail}")
    return int(found[-1][len(_MARK):])


def _fallback(why: str) -> int:
    """The plan is then an estimate: said on stderr, never fatal to the run."""
    print(f"note: could not measure a rank's own memory ({why}); the memory plan assumes "
          f"{FALLBACK_CPU_PROCESS_BYTES / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    return FALLBACK_CPU_PROCESS_BYTES


def _measure(imports: list[str]) -> int:
    """In the measuring interpreter: import, join a one-rank group, take a tiny step; the resident peak."""
    import importlib

    import torch
    import torch.distributed as dist

    from cpcompose.comm import all_reduce

    for name in ("cpcompose.train", *imports):
        importlib.import_module(name)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        all_reduce(torch.ones(1024))
        layers = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
        optimizer = torch.optim.AdamW(layers.parameters())
        q = torch.randn(1, 4, 256, 64, requires_grad=True)
        for dtype in (torch.float32, torch.bfloat16):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                attention = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
                loss = layers(torch.randn(512, 256)).sum() + attention.float().sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        dist.destroy_process_group()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


if __name__ == "__main__":
    print(f"{_MARK}{_measure(sys.argv[1:])}")
