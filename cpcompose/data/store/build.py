"""Writing a token store: documents streamed to flat files, in a temporary folder renamed into place at the end.

Files: ``tokens.bin`` (uint16 ids when the vocabulary fits, else uint32), ``offsets.bin`` (int64, where each
document starts, then the total), ``origin.bin`` (int64 pairs: the document's file number and line or row, for
errors found later), ``trained.bin`` (uint8 per token, completion/chat only: whether it carries the loss), and
the manifest, written last. Everything is fsynced before the rename, so a store that has its final name is
whole; a build that fails (a bad record, a full disk) removes its temporary folder.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from array import array
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np

from cpcompose.config import ConfigError
from cpcompose.data.formats import Document
from cpcompose.data.records import Record
from cpcompose.data.store.manifest import MANIFEST

__all__ = ["FLUSH_TOKENS", "Opener", "Progress", "token_dtype", "write_store"]

FLUSH_TOKENS = 1 << 20
"""Tokens buffered in memory before they are appended to the files (the builder's memory does not grow; a
longer document is appended in parts of this size)."""

Opener = Callable[[Path], IO[bytes]]
"""Opens a store file for writing (a seam: tests give one that fails as a full disk does)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class Progress:
    """One line every ``every_s`` seconds: bytes of text read of the total, tokens/s and the time left; and a
    last line when the build ends, if it said anything before (a build shorter than ``every_s`` is silent: the
    launch banner says it was built, and how long it took)."""

    def __init__(self, name: str, total_bytes: int, emit: Callable[[str], None] | None, every_s: float = 5.0):
        self.name, self.total, self.emit, self.every = name, max(total_bytes, 1), emit, every_s
        self.start = self.last = time.monotonic()
        self.spoke = False

    def update(self, done_bytes: int, tokens: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if self.emit is None or (not final and now - self.last < self.every) or (final and not self.spoke):
            return
        self.spoke, self.last, spent = True, now, max(now - self.start, 1e-9)
        eta = spent * max(self.total - done_bytes, 0) / max(done_bytes, 1)
        self.emit(f"token store {self.name}: {done_bytes / 2**20:.1f} of {self.total / 2**20:.1f} MiB of text, "
                  f"{tokens:,} tokens, {tokens / spent:,.0f} tokens/s, "
                  + (f"done in {spent:.1f} s" if final else f"about {eta:.0f} s left"))


def write_store(dest: Path, documents: Iterable[tuple[Record, Document]], manifest: dict[str, Any], *,
                files: list[Path], dtype: np.dtype, progress: Progress, opener: Opener | None = None) -> None:
    """Write ``documents`` as the store ``dest`` (which must not exist yet); the caller holds its build lock.

    Raises:
        ConfigError: writing failed (naming the folder and the OS's reason), or a record's error from
            ``documents``; either way nothing is left at ``dest`` or in the temporary folder.
    """
    tmp = dest.with_name(f".{dest.name}.building-{os.getpid()}")
    for stale in dest.parent.glob(f".{dest.name}.building-*"):  # of a killed build (the caller holds the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        counts = _write_arrays(tmp, documents, files, dtype, progress, opener or _open)
        manifest = {**manifest, **counts, "dtype": dtype.name, "built_unix": time.time(),
                    "build_seconds": time.monotonic() - progress.start}
        with (opener or _open)(tmp / MANIFEST) as f:
            f.write(json.dumps(manifest, indent=1).encode())
            _sync(f)
        _sync_folder(tmp)
        os.replace(tmp, dest)  # atomic: the store appears whole or not at all
        _sync_folder(dest.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"data.store_dir: writing the token store {dest} failed ({e.strerror or e}); free space "
                          "there or set data.store_dir to another folder; nothing was kept") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_arrays(tmp: Path, documents: Iterable[tuple[Record, Document]], files: list[Path], dtype: np.dtype,
                  progress: Progress, opener: Opener) -> dict[str, Any]:
    number = {f: i for i, f in enumerate(files)}
    names = ["tokens.bin", "offsets.bin", "origin.bin", "trained.bin"]
    handles = {name: opener(tmp / name) for name in names}
    ids, offsets, origin, trained = array("q"), array("q", [0]), array("q"), array("b")
    total = docs = text_bytes = 0
    has_mask = False
    try:
        for record, doc in documents:
            has_mask = has_mask or doc.trained is not None
            for start in range(0, len(doc.ids), FLUSH_TOKENS):  # a long document in parts: no copy of it whole
                ids.extend(doc.ids[start : start + FLUSH_TOKENS])
                if doc.trained is not None:
                    trained.extend(doc.trained[start : start + FLUSH_TOKENS])
                if len(ids) >= FLUSH_TOKENS:
                    _flush(handles, ids, offsets, origin, trained, dtype)
                    progress.update(text_bytes, total)
            total += len(doc.ids)
            docs += 1
            offsets.append(total)
            origin.extend((number[record.file], record.number))
            text_bytes += _text_bytes(record)
        _flush(handles, ids, offsets, origin, trained, dtype)
        for f in handles.values():
            _sync(f)
    finally:
        for f in handles.values():
            f.close()
    if not has_mask:
        (tmp / "trained.bin").unlink()
    progress.update(text_bytes, total, final=True)
    return {"num_tokens": total, "num_docs": docs, "has_mask": has_mask, "text_bytes": text_bytes}


def _flush(handles: dict[str, IO[bytes]], ids: array, offsets: array, origin: array, trained: array,
           dtype: np.dtype) -> None:
    handles["tokens.bin"].write(np.frombuffer(ids, dtype=np.int64).astype(dtype).tobytes())
    handles["offsets.bin"].write(offsets.tobytes())
    handles["origin.bin"].write(origin.tobytes())
    handles["trained.bin"].write(trained.tobytes())
    for buffer in (ids, offsets, origin, trained):
        del buffer[:]


def _text_bytes(record: Record) -> int:
    """About how much text a record held (its characters), for the progress line."""
    value = record.value
    if isinstance(value, str):
        return len(value)
    return sum(len(v) if isinstance(v, str) else len(str(v)) for v in value.values())


def _open(path: Path) -> IO[bytes]:
    return open(path, "wb")


def _sync(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
