"""Plain-text documents (data.format = "text"), concatenated and cut into fixed-length windows."""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import torch
from torch import Tensor

from cpcompose.config import ConfigError
from cpcompose.data._rng import EpochShuffle
from cpcompose.data.batch import IGNORE_INDEX, Sample

__all__ = ["TextSource", "short_corpus_error"]


def short_corpus_error(num_tokens: int, seq_len: int, path: object) -> ConfigError:
    """The error for a corpus with fewer than one window (``seq_len + 1`` tokens): the same before launch and in
    the ranks."""
    return ConfigError(f"training.seq_len: the corpus at {path} has {num_tokens} tokens, fewer than one window of "
                       f"training.seq_len + 1 = {seq_len + 1}; lower training.seq_len or add text")


class TextSource:
    """Windows of ``seq_len + 1`` tokens over the concatenated corpus, reshuffled every epoch.

    Each document is ``[BOS] tokens EOS`` (BOS when the tokenizer has one). Window ``w`` covers tokens
    ``[w*seq_len, w*seq_len + seq_len]``: inputs are its first seq_len tokens, labels its last seq_len,
    so consecutive windows share one token and none is wasted. Global sample ``i`` is window
    ``perm_e[i mod W]`` of epoch ``e = i // W``, with ``perm_e`` drawn from ``(seed, e)``.

    With ``pack``, samples carry ``cu_seqlens`` (document boundaries, from where each document started, not
    from EOS tokens, which a tokenizer may also use as BOS or pad) and no label crosses a boundary. A document
    cut by a window edge continues in another window as a document of its own: a document longer than seq_len
    becomes seq_len pieces. The whole corpus is tokenized in memory on every rank: meant for modest corpora.
    """

    def __init__(self, tokens: Tensor, starts: Tensor, *, seq_len: int, seed: int = 0, pack: bool = False,
                 path: object = "data.path") -> None:
        """Wrap an already tokenized corpus: ``tokens`` (1-D integers) and ``starts``, the sorted offsets at which
        its documents start (the first is 0).

        Raises:
            ConfigError: the corpus is shorter than one window of ``seq_len + 1`` tokens (names training.seq_len).
        """
        if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
            raise short_corpus_error(tokens.numel(), seq_len, path)
        self.tokens, self.starts, self.seq_len, self.seed, self.pack = tokens, starts.to(torch.int64), seq_len, seed, pack
        self.num_windows = (tokens.numel() - 1) // seq_len
        self._order = EpochShuffle(self.num_windows, seed)

    @classmethod
    def from_documents(cls, documents: Iterable[list[int]], *, seq_len: int, seed: int = 0, pack: bool = False,
                       path: object = "data.path") -> TextSource:
        """Concatenate tokenized documents (each already ``[BOS] ... EOS``)."""
        ids, starts = array("i"), array("q")  # int32 ids: a quarter of a list's memory; every vocabulary fits
        for doc in documents:
            starts.append(len(ids))
            ids.extend(doc)
        tokens = torch.frombuffer(ids, dtype=torch.int32).clone() if ids else torch.empty(0, dtype=torch.int32)
        return cls(tokens, torch.tensor(starts, dtype=torch.int64), seq_len=seq_len, seed=seed, pack=pack, path=path)

    def sample(self, index: int) -> Sample:
        """The sample at global position ``index`` (any non-negative integer: epochs repeat)."""
        start = self._order(index) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].to(torch.int64, copy=True)
        inputs, labels = window[:-1], window[1:].clone()
        if not self.pack:
            return Sample(input_ids=inputs, labels=labels)
        # Documents starting inside the window (a start at its last label's position ends the last document).
        lo, hi = torch.searchsorted(self.starts, torch.tensor([start + 1, start + self.seq_len + 1]))
        inside = self.starts[lo:hi] - start  # in 1..seq_len
        labels[inside - 1] = IGNORE_INDEX  # the token before a start would predict the next document's first
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), inside[inside < self.seq_len], torch.tensor([self.seq_len])])
        return Sample(input_ids=inputs, labels=labels, cu_seqlens=cu.to(torch.int32))
