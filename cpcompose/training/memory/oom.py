"""Out of memory, said plainly: one line with the peak reached, the budget, and a pointer to the plan.

Three ways a rank runs out, each ending the job with that one line:

* its resident set passes `training.memory_budget_gib` on CPU: `MemoryGuard`, a thread in the
  rank that reads its resident set every 20 ms, reports and ends the rank;
* an allocation fails: CUDA's `OutOfMemoryError` (with a budget, the caching allocator is held
  to it by `torch.cuda.set_per_process_memory_fraction`) or the CPU allocator's refusal;
  `is_out_of_memory` recognises both and the rank reports (`out_of_memory_line`);
* the kernel kills it (SIGKILL) while its resident set is near the budget or the host has
  almost no memory left: the launcher, which reads its ranks' resident sets as they run,
  says so (`killed_line`), where it used to say only "rank N was killed by SIGKILL".

The other ranks then fail in a collective; their lines are consequences, which the launcher
leaves out when one line already explains the failure.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from cpcompose.config import JobConfig
from cpcompose.training.memory.budget import Budget, memory_budget, run_plan
from cpcompose.training.memory.plan import GiB
from cpcompose.training.memory.resources import peak_resident_bytes, resident_bytes, run_device_type

__all__ = [
    "NEAR_BUDGET", "LOW_HOST_MEMORY", "MemoryGuard", "apply_cuda_budget", "is_out_of_memory", "killed_line",
    "out_of_memory_line", "peak_bytes",
]

NEAR_BUDGET = 0.8
"""A rank killed by SIGKILL ran out of memory if its last resident set read was at least this share of the budget ..."""
LOW_HOST_MEMORY = 0.1
"""... or the host's available memory had fallen below this share of its total."""

_CPU_REFUSALS = ("not enough memory", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(error: BaseException) -> bool:
    """A failed allocation: CUDA's OutOfMemoryError, or the CPU allocator's refusal (a RuntimeError)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(s in text for s in _CPU_REFUSALS)


def peak_bytes(device_type: str) -> int:
    """This rank's peak: CUDA's max_memory_allocated, or the CPU resident-set high-water mark."""
    return torch.cuda.max_memory_allocated() if device_type == "cuda" else peak_resident_bytes()


def _plan_note(config: JobConfig, world: int) -> str:
    try:
        return f"the plan predicted {run_plan(config, world).total / GiB:.2f} GiB: see --job.dry_run for its parts " \
               "and what would fit"
    except ValueError:
        return "see the memory plan with --job.dry_run"


def _budget_text(budget: Budget) -> str:
    return "no known budget" if budget.bytes is None else f"budget {budget.bytes / GiB:.2f} GiB ({budget.source})"


def out_of_memory_line(config: JobConfig, world: int, *, rank: int, step: int | None, peak: int, how: str) -> str:
    """The rank's own line: `how` it ran out, the peak it reached, the budget, the plan."""
    where = f" at step {step}" if step else " while starting"
    return (f"rank {rank} ran out of memory{where}: {how}; peak {peak / GiB:.2f} GiB, "
            f"{_budget_text(memory_budget(config, world))}; {_plan_note(config, world)}")


def killed_line(config: JobConfig, world: int, *, rank: int, peak: int, resident: int, available: int,
                total: int) -> str | None:
    """The launcher's line for a rank killed by SIGKILL, if memory explains it (else None).

    Args:
        peak, resident: the rank's resident-set high-water mark and its last resident set read, bytes.
        available, total: the host's available and total memory at that read, bytes.
    """
    budget = memory_budget(config, world)
    near = budget.bytes is not None and resident >= NEAR_BUDGET * budget.bytes
    if not (near or available < LOW_HOST_MEMORY * total):
        return None
    return (f"rank {rank} ran out of memory: killed by the kernel (SIGKILL); peak {peak / GiB:.2f} GiB resident, "
            f"{_budget_text(budget)}, the host had {available / GiB:.1f} of {total / GiB:.1f} GiB available; "
            f"{_plan_note(config, world)}")


def apply_cuda_budget(config: JobConfig) -> None:
    """Hold CUDA's caching allocator to `training.memory_budget_gib` (an allocation past it raises OutOfMemoryError)."""
    budget = config.training.memory_budget_gib
    if budget is None or run_device_type(config) != "cuda":
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget * GiB / total))


class MemoryGuard:
    """Watches this process's resident set; calls `on_exceed(resident bytes)` once it passes `budget` bytes.

    A thread, so that it also sees the middle of a step (where the peak is); `on_exceed` must end
    the process (the rank cannot be stopped safely from another thread any other way).
    """

    INTERVAL_S = 0.02

    def __init__(self, budget: int, on_exceed: Callable[[int], None]) -> None:
        self.budget, self.on_exceed = budget, on_exceed
        self.step: Callable[[], int | None] = lambda: None
        self._thread = threading.Thread(target=self._watch, name="cpcompose-memory-guard", daemon=True)

    def start(self) -> MemoryGuard:
        self._thread.start()
        return self

    def follow(self, step: Callable[[], int | None]) -> None:
        """Read the current step from `step` for the report (the trainer exists only after start-up)."""
        self.step = step

    def _watch(self) -> None:
        while True:
            now = resident_bytes()
            # The high-water mark, not the current size: a large tensor mapped and unmapped between two reads
            # (glibc's default for tensors over its mmap threshold) still passed the budget.
            if now is not None and max(now) > self.budget:
                self.on_exceed(max(now))
                return
            time.sleep(self.INTERVAL_S)
