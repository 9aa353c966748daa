"""A token store opened for reading: its arrays memory-mapped, their sizes checked against the manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cpcompose.config import ConfigError
from cpcompose.data.records import Record
from cpcompose.data.store.manifest import read_manifest

__all__ = ["TokenStore"]


class TokenStore:
    """The documents of one source: ``tokens`` (uint16/uint32), ``offsets`` (int64, documents + 1), ``origin``
    (int64 [documents, 2]: file number, line or row) and ``trained`` (uint8 per token, or None for plain text),
    all memory-mapped read-only, so opening costs the same for any corpus size and pages are shared by every
    process on the machine."""

    def __init__(self, folder: Path) -> None:
        """Open the store in ``folder``.

        Raises:
            ConfigError: not a store of ours, or a file shorter or longer than the manifest says (truncated or
                altered: naming the file).
        """
        self.folder = folder
        self.manifest: dict[str, Any] = read_manifest(folder)
        m = self.manifest
        self.num_tokens, self.num_docs = int(m["num_tokens"]), int(m["num_docs"])
        self.tokens = self._map("tokens.bin", np.dtype(m["dtype"]), (self.num_tokens,))
        self.offsets = self._map("offsets.bin", np.dtype(np.int64), (self.num_docs + 1,))
        self.origin = self._map("origin.bin", np.dtype(np.int64), (self.num_docs, 2))
        self.trained = self._map("trained.bin", np.dtype(np.uint8), (self.num_tokens,)) if m["has_mask"] else None
        if self.num_docs and (self.offsets[0] != 0 or self.offsets[-1] != self.num_tokens):
            raise ConfigError(f"data.path: {folder / 'offsets.bin'} does not match {folder / 'tokens.bin'} "
                              "(an altered store); rebuild it")

    def _map(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        path = self.folder / name
        want = int(np.prod(shape)) * dtype.itemsize
        try:
            size = path.stat().st_size
        except OSError:
            raise ConfigError(f"data.path: the token store {self.folder} has no {name} (an incomplete copy?); copy "
                              "or rebuild the whole folder") from None
        if size != want:
            raise ConfigError(f"data.path: {path} has {size} bytes, its manifest says {want} (truncated or altered); "
                              "copy or rebuild the whole store")
        if want == 0:
            return np.zeros(shape, dtype=dtype)
        # Copy-on-write, so torch can wrap it without a warning; nothing writes, so nothing is ever copied.
        return np.memmap(path, dtype=dtype, mode="c", shape=shape)

    @property
    def pad_id(self) -> int:
        """The id that fills the rest of a packed row."""
        return int(self.manifest["pad_id"])

    def lengths(self) -> np.ndarray:
        """Tokens of each document (int64; one pass over the offsets)."""
        return np.diff(self.offsets)

    def where(self, doc: int) -> str:
        """The file and line (or row) document ``doc`` came from, for error messages."""
        number, line = (int(v) for v in self.origin[doc])
        return Record(Path(self.manifest["files"][number]["path"]), line, None).where
