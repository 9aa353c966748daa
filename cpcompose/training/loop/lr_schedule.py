"""Learning-rate schedules: linear warmup, then cosine decay or constant."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["build_lr_scheduler", "lr_factor", "warmup_note"]


def warmup_note(warmup_steps: int, total_steps: int) -> str | None:
    """The banner's line when the warmup is shortened to the run (`lr_factor`), else None."""
    if warmup_steps <= total_steps:
        return None
    return (f"note: lr_scheduler.warmup_steps = {warmup_steps} is more than training.steps = {total_steps}: "
            f"the warmup is shortened to {total_steps} steps")


def lr_factor(step: int, *, name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based).

    A warmup longer than the run is shortened to the run (`warmup_note` says so), so
    that a short trial of a long run's config runs as is, warming up over all its steps.
    """
    warmup_steps = min(warmup_steps, total_steps)
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if name == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: Optimizer, *, name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> LambdaLR:
    """A LambdaLR (its state_dict is just the step count, so it checkpoints anywhere)."""
    return LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, name=name, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
        ),
    )
