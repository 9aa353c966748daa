"""`training.mixed_precision` as FSDP2 applies it: the dtype each unit is gathered and computed in.

As torchtitan: with FSDP, `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`; the
sharded float32 parameters are the optimizer's master weights and no whole-model cast copy exists.
Without FSDP (one rank over dp x cp) the trainer falls back to autocast.
"""

from __future__ import annotations

import torch

from cpcompose.config import JobConfig

__all__ = ["compute_dtype"]


def compute_dtype(config: JobConfig) -> torch.dtype | None:
    """The dtype FSDP2 gathers parameters in for compute; None: float32 (the parameters' own)."""
    return torch.bfloat16 if config.training.mixed_precision == "bfloat16" else None
