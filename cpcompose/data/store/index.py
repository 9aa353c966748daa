"""The sample index of a packed source: which pieces of which documents fill each row, built once per store and
row length and memory-mapped by every rank, so no rank reads more of the corpus than its own samples.

Completion/chat records follow data.truncate (longer than a row: an error, or their first row's worth) and a
record with no trained token left is dropped; plain text is cut only where a document is longer than a row.
Documents at least ``long_doc_tokens`` long are packed ``long_doc_repeat`` times (upsampling by length).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cpcompose.config import ConfigError
from cpcompose.data.formats import record_too_long
from cpcompose.data.store.lock import build_lock
from cpcompose.data.store.packing import best_fit_rows, pieces_of
from cpcompose.data.store.tokens import TokenStore

__all__ = ["PackPlan", "RowIndex", "index_prefix", "row_index"]


@dataclass(frozen=True)
class PackPlan:
    """What decides the rows: their length and the record and upsampling policies."""

    seq_len: int
    truncate: bool = False
    long_doc_tokens: int | None = None
    long_doc_repeat: int = 1

    def key(self, store: TokenStore) -> str:
        """The index folder's name: the store's, then a digest of this plan and this build of the store (a rebuilt
        store's old indexes are found by the name and removed)."""
        text = json.dumps([self.__dict__, store.manifest["built_unix"], store.manifest["tokenizer"]], sort_keys=True)
        return f"{index_prefix(store.folder)}{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def index_prefix(store_folder: Path) -> str:
    """How the names of a store's sample indexes start."""
    return f"{store_folder.name}.index-"


@dataclass(frozen=True)
class RowIndex:
    """Rows as pieces: ``pieces`` int64 ``[P, 3]`` (document, start, length), ``row_starts`` int64 ``[R + 1]``."""

    pieces: np.ndarray
    row_starts: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.row_starts.size - 1


def row_index(store: TokenStore, plan: PackPlan, root: Path, *, wait_s: float) -> RowIndex:
    """The row index of ``store`` under ``plan``, read from ``root`` or built there first (one process builds,
    the others wait for it).

    Raises:
        ConfigError: a record longer than a row without data.truncate (naming its file and line), or nothing to
            train on, or the build lock was held past ``wait_s``.
    """
    folder = root / plan.key(store)
    if not folder.is_dir():
        with build_lock(folder, timeout_s=wait_s):
            if not folder.is_dir():
                _write(folder, *_plan_rows(store, plan))
    return RowIndex(np.load(folder / "pieces.npy", mmap_mode="r"), np.load(folder / "row_starts.npy", mmap_mode="r"))


def _plan_rows(store: TokenStore, plan: PackPlan) -> tuple[np.ndarray, np.ndarray]:
    lengths, seq_len = store.lengths(), plan.seq_len
    repeats = np.ones_like(lengths)
    if store.trained is not None:
        too_long = np.flatnonzero(lengths > seq_len)
        if too_long.size and not plan.truncate:
            doc = int(too_long[0])
            raise record_too_long(store.where(doc), int(lengths[doc]), seq_len)
        lengths = np.minimum(lengths, seq_len)
        repeats[_trained_targets(store, lengths) == 0] = 0  # the first id is predicted by nothing
    if plan.long_doc_tokens is not None:
        repeats[store.lengths() >= plan.long_doc_tokens] *= plan.long_doc_repeat
    pieces = pieces_of(lengths, seq_len, repeats)
    if pieces.shape[0] == 0:
        raise ConfigError(f"data.path: no record in {store.manifest['source']} has a token to train on within its "
                          f"first training.seq_len = {seq_len} tokens; raise training.seq_len")
    return best_fit_rows(pieces, seq_len)


def _trained_targets(store: TokenStore, lengths: np.ndarray) -> np.ndarray:
    """Per record, how many of its ids after the first (within ``lengths``) carry the loss."""
    assert store.trained is not None
    starts = store.offsets[:-1]
    counts = np.zeros(lengths.size, dtype=np.int64)
    for lo in range(0, lengths.size, 1 << 16):  # a bounded prefix sum at a time
        hi = min(lo + (1 << 16), lengths.size)
        a, b = int(starts[lo]) , int(starts[hi - 1] + lengths[hi - 1])
        cum = np.concatenate([[0], np.cumsum(store.trained[a:b], dtype=np.int64)])
        s = starts[lo:hi] - a
        counts[lo:hi] = cum[s + lengths[lo:hi]] - cum[np.minimum(s + 1, s + lengths[lo:hi])]
    return counts


def _write(folder: Path, pieces: np.ndarray, row_starts: np.ndarray) -> None:
    tmp = folder.with_name(f".{folder.name}.building-{os.getpid()}")
    for stale in folder.parent.glob(f".{folder.name}.building-*"):  # of a killed build (this process holds the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, array in (("pieces.npy", pieces), ("row_starts.npy", row_starts)):
            with open(tmp / name, "wb") as f:
                np.save(f, np.ascontiguousarray(array))
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, folder)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"data.store_dir: writing the sample index {folder} failed ({e.strerror or e}); free "
                          "space there or set data.store_dir to another folder") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
