"""A long-context copy task: the second half of each sequence repeats the first.

    BOS x1 x2 ... x(h-1) | COPY x1 x2 ... x(h-1)        (h = seq_len / 2)

Only the second half carries a loss: position ``h + j`` predicts ``x(j+1)``, which
appeared exactly ``h - 1`` tokens earlier and nowhere nearby (the symbols are
random). Under the zigzag layout the second half's chunks live on different CP
ranks than the first half's chunks they copy from (with cp=2, chunk 3 on rank 0
reads chunk 1 on rank 1, chunk 2 on rank 1 reads chunk 0 on rank 0), so the loss
can only fall if attention crosses the shards. Unlike key/value recall, a small
model learns it within a couple of hundred steps on a CPU: the loss goes from
ln(num_symbols) to near zero, which makes the debug run a visible end-to-end check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpcompose.data._rng import seeded_generator
from cpcompose.data.batch import IGNORE_INDEX, ParamProblem, Sample

__all__ = ["SyntheticCopy", "copy_task_problem"]


def copy_task_problem(seq_len: int) -> ParamProblem | None:
    """Why the copy task cannot fill sequences of ``seq_len`` tokens, or None if it can.

    Each half needs its marker (BOS, COPY) and at least one symbol, and the halves must be equal.
    """
    if seq_len < 4 or seq_len % 2:
        return ParamProblem("seq_len", f"{seq_len} must be even and >= 4 for the copy task")
    return None


@dataclass(frozen=True)
class SyntheticCopy:
    """Sample ``i`` is a pure function of ``(seed, i)``: no state, no global RNG."""

    seq_len: int
    """Tokens per sample (even)."""
    seed: int = 0
    """Mixed into every sample's generator."""
    num_symbols: int = 64
    """Ordinary symbols (ids 0..num_symbols-1) to copy."""

    def __post_init__(self) -> None:
        if problem := copy_task_problem(self.seq_len):
            raise ValueError(f"{problem.param}: {problem.reason}")

    @property
    def bos_id(self) -> int:
        return self.num_symbols

    @property
    def copy_id(self) -> int:
        """Marks the start of the second half."""
        return self.num_symbols + 1

    @property
    def vocab_size(self) -> int:
        """Same id budget as the recall task (num_symbols + 4), so configs swap freely."""
        return self.num_symbols + 4

    def sample(self, index: int) -> Sample:
        """The sample at global position ``index``."""
        half = self.seq_len // 2
        symbols = torch.randint(0, self.num_symbols, (half - 1,), generator=seeded_generator(self.seed, index))
        ids = torch.cat([torch.tensor([self.bos_id]), symbols, torch.tensor([self.copy_id]), symbols])
        labels = torch.full((self.seq_len,), IGNORE_INDEX)
        labels[half : self.seq_len - 1] = ids[half + 1 :]
        return Sample(input_ids=ids, labels=labels)
