"""Fine-tuning records (data.format = "completion" or "chat") packed whole into rows of seq_len tokens."""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import torch
from torch import Tensor

from cpcompose.data._rng import EpochShuffle
from cpcompose.data.batch import IGNORE_INDEX, Sample

__all__ = ["SupervisedSource"]


class SupervisedSource:
    """Rows of whole records, each record a document of the packed layout, reshuffled every epoch.

    Records are laid end to end in file order; a record that does not fit in what is left of a row starts the
    next row (records are never split: a cut conversation would train an answer without its question). The
    rest of a row is padding, a document of its own with no loss. Within a record, ``labels[t]`` is the id at
    ``t + 1`` where that id is trained (the completion, or what the assistant wrote), -100 elsewhere and at the
    record's last token, so no loss crosses a record. Sample ``i`` is row ``perm_e[i mod R]`` of epoch
    ``e = i // R``: a pure function of ``(seed, i)``, like the text windows.
    """

    def __init__(self, ids: Tensor, trained: Tensor, offsets: Tensor, rows: Tensor, *, seq_len: int, pad_id: int,
                 seed: int = 0) -> None:
        """``ids``/``trained``: the records' tokens end to end (int32 / bool); ``offsets``: where each record starts,
        then the total (``R + 1`` entries); ``rows``: the first record of each row, then ``R``.

        Raises:
            ValueError: no row, or a row longer than ``seq_len``.
        """
        if rows.numel() < 2 or int((offsets[rows[1:]] - offsets[rows[:-1]]).max()) > seq_len:
            raise ValueError(f"need at least one row, each of at most seq_len = {seq_len} tokens")
        self.ids, self.trained, self.offsets, self.rows = ids, trained, offsets, rows
        self.seq_len, self.pad_id, self.seed = seq_len, pad_id, seed
        self.num_rows = rows.numel() - 1
        self._order = EpochShuffle(self.num_rows, seed)

    @classmethod
    def from_documents(cls, documents: Iterable[tuple[list[int], list[bool]]], *, seq_len: int, pad_id: int,
                       seed: int = 0) -> SupervisedSource:
        """Pack ``(ids, trained)`` records, each at most ``seq_len`` ids, greedily in order."""
        ids, trained, offsets, rows = array("i"), array("b"), array("q", [0]), array("q", [0])
        for doc_ids, doc_trained in documents:
            if len(ids) + len(doc_ids) - offsets[rows[-1]] > seq_len:
                rows.append(len(offsets) - 1)
            ids.extend(doc_ids)
            trained.extend(doc_trained)
            offsets.append(len(ids))
        if len(offsets) > 1:
            rows.append(len(offsets) - 1)
        return cls(_tensor(ids, torch.int32), _tensor(trained, torch.int8).bool(),
                   torch.tensor(offsets, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64),
                   seq_len=seq_len, pad_id=pad_id, seed=seed)

    @property
    def num_records(self) -> int:
        """Records in the corpus."""
        return self.offsets.numel() - 1

    def sample(self, index: int) -> Sample:
        """The sample at global position ``index`` (any non-negative integer: epochs repeat)."""
        row = self._order(index)
        first, last = int(self.rows[row]), int(self.rows[row + 1])
        bounds = self.offsets[first : last + 1] - self.offsets[first]  # record starts in the row, then its end
        a, used = int(self.offsets[first]), int(bounds[-1])
        ids = self.ids[a : a + used].to(torch.int64)
        inputs = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        inputs[:used] = ids
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.int64)
        labels[: used - 1] = ids[1:].masked_fill(~self.trained[a + 1 : a + used], IGNORE_INDEX)
        labels[bounds[1:] - 1] = IGNORE_INDEX  # a record's last token would predict the next record's first
        cu = bounds if used == self.seq_len else torch.cat([bounds, torch.tensor([self.seq_len])])
        return Sample(input_ids=inputs, labels=labels, cu_seqlens=cu.to(torch.int32))


def _tensor(values: array, dtype: torch.dtype) -> Tensor:
    return torch.frombuffer(values, dtype=dtype).clone() if values else torch.empty(0, dtype=dtype)
