"""What the run gets from its machine: the device type, glibc's allocator settings, and memory as the OS counts it.

Shared by the launcher (which watches its ranks), the memory plan (which predicts for glibc's own
allocator settings, and says so when the environment changes them) and the out-of-memory reports
(which read the resident sets).
"""

from __future__ import annotations

import os
import resource

import torch

from cpcompose.config import JobConfig

__all__ = [
    "ALLOCATOR_VARIABLES", "allocator_warning", "host_memory", "oversubscription_warning", "peak_resident_bytes",
    "resident_bytes", "run_device_type", "usable_cores",
]

ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX",
                       "GLIBC_TUNABLES", "LD_PRELOAD")
"""Environment variables that change how the CPU ranks' memory is allocated (glibc's settings, a preloaded
allocator). The launcher leaves them as they are and the plan predicts glibc's defaults.

Why not the heap settings the launcher used to set (`MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` at
4 GiB: every tensor from the heap, nothing given back)? They saved the page faults of mapping large tensors
afresh each step, but the heap fragments: a parameter-dominated Llama (128k vocabulary, cp = 2, bf16) peaked at
6.9-7.9 GiB per rank against a plan of 3.9 and measured peaks of 3.9 with glibc's defaults, growing for four
steps. With glibc's defaults and AdamW fused (no per-parameter temporaries) its steps are as fast as they were
with those settings and the for-loop AdamW (scripts/benchmarks/bench_host_memory.py)."""


def run_device_type(config: JobConfig) -> str:
    """"cuda" or "cpu", as the trainer will choose."""
    device = config.training.device
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def allocator_warning(config: JobConfig) -> str | None:
    """The banner's warning when the environment changes the CPU ranks' allocator, else None."""
    changed = [name for name in ALLOCATOR_VARIABLES if os.environ.get(name)]
    if run_device_type(config) != "cpu" or not changed:
        return None
    return (f"warning: {', '.join(changed)} set: the memory plan predicts glibc's own allocator settings, and with "
            "others a rank's resident set can pass it (a heap that keeps everything fragments across steps); "
            "unset them to train within the plan")


def _status_kib(pid: int | str, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def resident_bytes(pid: int | str = "self") -> tuple[int, int] | None:
    """(current, peak) resident set of a process, bytes; None once it is gone."""
    try:
        return _status_kib(pid, "VmRSS:") * 1024, _status_kib(pid, "VmHWM:") * 1024
    except (OSError, StopIteration):
        return None


def peak_resident_bytes() -> int:
    """This process's resident-set high-water mark since it started its program.

    Read from /proc (`VmHWM`, kept per address space, so new at `exec`), not from
    `getrusage`: Linux carries `ru_maxrss` across `exec`, so a rank started from a large
    parent (pytest after a suite, a notebook) reported the parent's resident set at the
    fork as its own peak (measured: 960 MiB for a run that peaked at 450).
    """
    found = resident_bytes()
    if found is not None:
        return found[1]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: Linux reports KiB


def host_memory() -> tuple[int, int]:
    """(total, available) RAM of this host, bytes."""
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemTotal"], info["MemAvailable"]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def oversubscription_warning(config: JobConfig, local_ranks: int, cores: int) -> str | None:
    """The banner's warning when more CPU ranks run on this host than it has cores, else None.

    Each rank then gets a fraction of a core, and ranks that wait for each other in every collective
    wait for the slowest: the run is correct, only slower than fewer ranks would be.
    """
    if run_device_type(config) != "cpu" or local_ranks <= cores:
        return None
    return (f"warning: {local_ranks} ranks on {cores} CPU core{'s' if cores > 1 else ''}: each rank gets "
            f"{cores / local_ranks:.2g} of a core and every collective waits for the slowest; the results are the "
            f"same, only slower: use at most {cores} ranks on this machine (fewer parallelism.cp / dp_shard)")
