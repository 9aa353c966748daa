"""Document boundaries inside packed sequences."""

from __future__ import annotations

import torch
from torch import Tensor

from cpcompose.data.batch import IGNORE_INDEX

__all__ = ["document_cu_seqlens", "long_tailed_lengths", "mask_document_crossings"]


def document_cu_seqlens(input_ids: Tensor, eos_id: int) -> Tensor:
    """Cumulative document lengths of one packed ``[seq_len]`` sequence, in FlashAttention's format.

    A document ends with its EOS, so a new one starts right after each EOS. The result is int32,
    starts at 0, strictly increases and ends at ``seq_len``; an EOS in the last position starts
    nothing inside this sequence.
    """
    seq_len = input_ids.numel()
    starts = (input_ids[:-1] == eos_id).nonzero().flatten() + 1
    return torch.cat([torch.zeros(1, dtype=starts.dtype), starts, torch.tensor([seq_len])]).to(torch.int32)


def mask_document_crossings(input_ids: Tensor, labels: Tensor, eos_id: int) -> Tensor:
    """``labels`` with -100 at every EOS position.

    The label there is the next document's first token, which attention restricted to documents
    cannot see; the last real token of a document still predicts its EOS.
    """
    return labels.masked_fill(input_ids == eos_id, IGNORE_INDEX)


def long_tailed_lengths(total: int, seed: int, *, scale: int = 64, alpha: float = 1.2) -> list[int]:
    """Document lengths drawn from a Pareto tail (most short, a few very long), filling `total` tokens.

    What realistic packs look like; the tests and the benchmark measure load balance on them.
    """
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(scale * (1 - torch.rand((), generator=g).item()) ** (-1 / alpha)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]
