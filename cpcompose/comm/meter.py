"""The byte meter every communication helper feeds: what this rank sends, by operation."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from torch import Tensor

__all__ = ["CommMeter", "nbytes"]


@dataclass
class CommMeter:
    """Bytes sent by this rank, by operation ("p2p", "all_gather", ...)."""

    bytes_sent: Counter[str] = field(default_factory=Counter)
    strategies: Counter[str] = field(default_factory=Counter)  # calls per strategy `auto` chose
    predicted_s: float = 0.0  # the cost model's predicted seconds of those calls
    waited_s: Counter[str] = field(default_factory=Counter)  # seconds blocked waiting for a posted op, by operation

    def add(self, op: str, nbytes: int) -> None:
        self.bytes_sent[op] += int(nbytes)

    def note_wait(self, op: str, seconds: float) -> None:
        """Time spent blocked on a posted `op` (what of it the work in between did not hide)."""
        self.waited_s[op] += seconds

    def note_choice(self, label: str, predicted_s: float) -> None:
        """One call whose strategy `strategy="auto"` chose (`label`, e.g. "alltoall_ring(a=2)")."""
        self.strategies[label] += 1
        self.predicted_s += predicted_s

    @property
    def total(self) -> int:
        return sum(self.bytes_sent.values())

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.strategies.clear()
        self.predicted_s = 0.0
        self.waited_s.clear()


def nbytes(tensors: Sequence[Tensor]) -> int:
    """The bytes `tensors` hold together."""
    return sum(t.numel() * t.element_size() for t in tensors)
