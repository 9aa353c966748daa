"""Your own text: .txt / .jsonl files, tokenized, concatenated and cut into fixed-length windows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from cpcompose.data._rng import seeded_generator
from cpcompose.data.batch import Sample
from cpcompose.data.documents import document_cu_seqlens, mask_document_crossings
from cpcompose.data.tokenizer import Tokenizer

__all__ = ["TextSource", "read_documents"]

_SUFFIXES = (".txt", ".jsonl")


def read_documents(path: str | Path) -> Iterator[str]:
    """Documents under ``path``: a .txt file is one document, each line of a .jsonl file is one
    ``{"text": ...}`` object, a directory holds such files (recursively, in sorted order so every
    rank reads the same corpus).

    Raises:
        FileNotFoundError: ``path`` does not exist or a directory holds no .txt/.jsonl file.
        ValueError: a .jsonl line that is not an object with a "text" string (names file and line).
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
        if not files:
            raise FileNotFoundError(f"data.path: no .txt or .jsonl files under {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"data.path: {path} does not exist")
    for file in files:
        if file.suffix != ".jsonl":
            yield file.read_text(encoding="utf-8")
            continue
        with file.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file}:{lineno}: invalid JSON: {e}") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f'{file}:{lineno}: expected an object with a "text" string')
                yield record["text"]


class TextSource:
    """Windows of ``seq_len + 1`` tokens over the concatenated corpus, reshuffled every epoch.

    Each document is ``[BOS] tokens EOS`` (BOS when the tokenizer has one). Window ``w`` covers tokens
    ``[w*seq_len, w*seq_len + seq_len]``: inputs are its first seq_len tokens, labels its last seq_len,
    so consecutive windows share one token and none is wasted. Global sample ``i`` is window
    ``perm_e[i mod W]`` of epoch ``e = i // W``, with ``perm_e`` drawn from ``(seed, e)``.
    With ``pack``, samples also carry ``cu_seqlens`` and the label at each EOS is ignored.
    The whole corpus is tokenized in memory on every rank: meant for modest corpora.
    """

    def __init__(self, tokens: Tensor, *, seq_len: int, eos_id: int, seed: int = 0, pack: bool = False) -> None:
        """Wrap an already tokenized corpus ``tokens`` (1-D integer tensor).

        Raises:
            ValueError: the corpus is shorter than one window of ``seq_len + 1`` tokens.
        """
        if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
            raise ValueError(f"the corpus has {tokens.numel()} tokens, fewer than one window of "
                             f"training.seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.eos_id, self.seed, self.pack = tokens, seq_len, eos_id, seed, pack
        self.num_windows = (tokens.numel() - 1) // seq_len
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    @classmethod
    def from_path(cls, path: str | Path, tokenizer: Tokenizer, *, seq_len: int, seed: int = 0,
                  pack: bool = False) -> TextSource:
        """Read and tokenize every document under ``path`` (see :func:`read_documents`)."""
        bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        ids: list[int] = []
        for doc in read_documents(path):
            ids += bos + tokenizer.encode(doc) + [tokenizer.eos_id]
        # int32 halves the corpus' memory; every vocabulary fits in it.
        return cls(torch.tensor(ids, dtype=torch.int32), seq_len=seq_len, eos_id=tokenizer.eos_id, seed=seed, pack=pack)

    def _window(self, index: int) -> int:
        epoch, pos = divmod(index, self.num_windows)
        if epoch != self._epoch:  # one cached permutation: ranks read indices in increasing order
            self._perm = torch.randperm(self.num_windows, generator=seeded_generator(self.seed, epoch))
            self._epoch = epoch
        return int(self._perm[pos])

    def sample(self, index: int) -> Sample:
        """The sample at global position ``index`` (any non-negative integer: epochs repeat)."""
        start = self._window(index) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].to(torch.int64, copy=True)
        inputs, labels = window[:-1], window[1:]
        if not self.pack:
            return Sample(input_ids=inputs, labels=labels.clone())
        return Sample(input_ids=inputs, labels=mask_document_crossings(inputs, labels, self.eos_id),
                      cu_seqlens=document_cu_seqlens(inputs, self.eos_id))
