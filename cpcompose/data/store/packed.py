"""Packed rows read from a token store: each sample one row of whole documents (or pieces of longer ones)."""

from __future__ import annotations

import numpy as np
import torch

from cpcompose.data._rng import EpochShuffle
from cpcompose.data.batch import IGNORE_INDEX, Sample
from cpcompose.data.store.index import RowIndex
from cpcompose.data.store.tokens import TokenStore

__all__ = ["PackedSource"]


class PackedSource:
    """Sample ``i`` is row ``perm_e[i mod R]`` of epoch ``e = i // R`` (``perm_e`` drawn from ``(seed, e)``), a
    pure function of ``(seed, i)``, so any rank reads any sample and resuming with another dp size is exact.

    A row holds its pieces end to end, then padding (a document of its own with no loss). Within a piece,
    ``labels[t]`` is the id at ``t + 1`` when that id is trained (every id of plain text; the completion or
    what the assistant wrote in records), -100 at the piece's last token, so no loss crosses a document.
    """

    def __init__(self, store: TokenStore, index: RowIndex, *, seq_len: int, seed: int = 0) -> None:
        self.store, self.index, self.seq_len, self.seed = store, index, seq_len, seed
        self.num_rows = index.num_rows
        self._order = EpochShuffle(self.num_rows, seed)

    def sample(self, index: int) -> Sample:
        """The sample at global position ``index`` (any non-negative integer: epochs repeat)."""
        row = self._order(index)
        lo, hi = int(self.index.row_starts[row]), int(self.index.row_starts[row + 1])
        inputs = np.full(self.seq_len, self.store.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        bounds, at = [0], 0
        for doc, start, length in self.index.pieces[lo:hi].tolist():
            a = int(self.store.offsets[doc]) + start
            ids = self.store.tokens[a : a + length].astype(np.int64)
            inputs[at : at + length] = ids
            targets = ids[1:]
            if self.store.trained is not None:
                targets = np.where(self.store.trained[a + 1 : a + length].astype(bool), targets, IGNORE_INDEX)
            labels[at : at + length - 1] = targets
            at += length
            bounds.append(at)
        if at < self.seq_len:
            bounds.append(self.seq_len)
        return Sample(input_ids=torch.from_numpy(inputs), labels=torch.from_numpy(labels),
                      cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
