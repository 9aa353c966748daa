"""What the data sources produce: one sample, a batch of them, the source protocol, and a parameter problem."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "Batch", "ParamProblem", "Sample", "SampleSource"]

IGNORE_INDEX = -100
"""Label of positions without a loss (``torch.nn.functional.cross_entropy``'s default ignore_index)."""


class ParamProblem(NamedTuple):
    """A source parameter that cannot be honoured, and why.

    Sources report problems by their own parameter names; the config maps them to its keys.
    """

    param: str
    """The parameter to change, e.g. ``"num_pairs"``."""
    reason: str
    """Why, starting with its value."""


@dataclass(frozen=True)
class Sample:
    """One full-length sequence."""

    input_ids: Tensor
    """``[seq_len]`` int64 token ids."""
    labels: Tensor
    """``[seq_len]`` int64, already shifted: ``labels[t]`` is the target of position ``t``; -100 ignores it."""
    cu_seqlens: Tensor | None = None
    """int32 document boundaries ``[0, ..., seq_len]`` when packing, else ``None``."""


class SampleSource(Protocol):
    """A map from a global sample index (0, 1, 2, ...) to a sample, deterministic and unbounded."""

    seq_len: int

    def sample(self, index: int) -> Sample:
        """The sample at global position ``index``."""
        ...


@dataclass(frozen=True)
class Batch:
    """One data-parallel rank's micro-batch of full sequences; the trainer shards it along the sequence for cp."""

    input_ids: Tensor
    """``[batch, seq_len]`` int64."""
    labels: Tensor
    """``[batch, seq_len]`` int64, shifted like :attr:`Sample.labels`."""
    cu_seqlens: list[Tensor] | None = None
    """Per sample, int32 document boundaries starting at 0 and ending at seq_len (``data.pack`` only)."""

    @classmethod
    def stack(cls, samples: list[Sample]) -> Batch:
        """Stack samples of equal length; keep cu_seqlens as a list since their lengths differ."""
        cu = [s.cu_seqlens for s in samples]
        return cls(
            input_ids=torch.stack([s.input_ids for s in samples]),
            labels=torch.stack([s.labels for s in samples]),
            cu_seqlens=None if any(c is None for c in cu) else cu,  # type: ignore[arg-type]
        )

    def to(self, device: torch.device | str) -> Batch:
        """A copy on ``device``."""
        return Batch(
            input_ids=self.input_ids.to(device),
            labels=self.labels.to(device),
            cu_seqlens=None if self.cu_seqlens is None else [c.to(device) for c in self.cu_seqlens],
        )
