"""Data files read record by record, each record knowing where it came from.

A .txt file is one record (its whole text; one above TXT_PART_BYTES is read in parts of about that size, cut
at line breaks, each a record), a .jsonl file one record per non-blank line (a JSON object), a .parquet file
one record per row (a dict of its columns; needs pyarrow), an .arrow file (what `datasets`' save_to_disk
writes) one record per row too, a folder the files under it, recursively, in sorted order so every rank reads
the same corpus. Every file is read streaming: memory does not grow with its size. Problems are ConfigErrors
naming the file (and line or row): an empty file, a file that is not UTF-8, a line that is not a JSON object, a
parquet or arrow file that cannot be read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpcompose.config import ConfigError

__all__ = ["SUFFIXES", "Record", "data_files", "iter_records"]

SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow")

TXT_PART_BYTES = 64 << 20
"""A .txt file larger than this is read as parts of about this size (cut after a line break), each a document."""

_PARQUET_BATCH = 1024  # rows converted to Python at a time


@dataclass(frozen=True)
class Record:
    """One document or record, and where it is."""

    file: Path
    number: int
    """1-based line of a .jsonl file, row of a .parquet/.arrow file, or part of a .txt file (1 for most)."""
    value: Any
    """A .txt file's text; a JSON value (an object, unless the file is malformed); a parquet row as a dict."""

    @property
    def where(self) -> str:
        """``file`` (txt), ``file:line`` (jsonl) or ``file row n`` (parquet), for error messages."""
        if self.file.suffix == ".jsonl":
            return f"{self.file}:{self.number}"
        if self.file.suffix == ".txt":
            return str(self.file) if self.number == 1 else f"{self.file} part {self.number}"
        return f"{self.file} row {self.number}"


def data_files(path: str | Path) -> list[Path]:
    """The data files ``path`` names: itself, or the .txt/.jsonl/.parquet files under a folder, sorted.

    Raises:
        ConfigError: ``path`` does not exist, a folder holds no such file, or a file has another suffix.
    """
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            raise ConfigError(f"data.path: {path} holds several splits (a DatasetDict saved with save_to_disk); point "
                              f"data.path at one of them, e.g. {path / 'train'}")
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise ConfigError(f"data.path: no {', '.join(SUFFIXES[:-1])} files under {path} (nor {SUFFIXES[-1]} "
                              "shards of a dataset saved with `datasets`' save_to_disk)")
        return files
    if not path.is_file():
        raise ConfigError(f"data.path: {path} does not exist")
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"data.path: {path} is not a {', '.join(SUFFIXES[:-1])} file (nor a {SUFFIXES[-1]} shard of "
                          "`datasets`' save_to_disk), or a folder of them")
    return [path]


def iter_records(files: list[Path], *, limit_per_file: int | None = None) -> Iterator[Record]:
    """Every record of ``files`` in order, or the first ``limit_per_file`` of each.

    Raises:
        ConfigError: naming data.path and the file (and line or row).
    """
    for file in files:
        read = {".txt": _txt, ".jsonl": _jsonl, ".parquet": _parquet, ".arrow": _arrow}[file.suffix]
        for count, record in enumerate(read(file), 1):
            yield record
            if limit_per_file is not None and count >= limit_per_file:
                break


def _txt(file: Path) -> Iterator[Record]:
    with file.open("rb") as f:
        part, start = 0, 0
        while raw := f.read(TXT_PART_BYTES):
            if len(raw) == TXT_PART_BYTES:
                raw += f.readline()  # end at a line break: never inside a UTF-8 character
            part += 1
            if part == 1 and len(raw) < TXT_PART_BYTES and not raw.strip():
                raise ConfigError(f"data.path: {file} is empty; delete it or give it text")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"data.path: {file} is not UTF-8 text (byte {start + e.start}); cpcompose reads "
                                  "UTF-8 .txt/.jsonl files and .parquet/.arrow files") from None
            start += len(raw)
            yield Record(file, part, text)
    if part == 0:
        raise ConfigError(f"data.path: {file} is empty; delete it or give it text")


def _jsonl(file: Path) -> Iterator[Record]:
    seen = False
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"data.path: {file}:{lineno} is not UTF-8 text (byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data.path: {file}:{lineno}: invalid JSON ({e})") from None
            if not isinstance(value, dict):
                raise ConfigError(f"data.path: {file}:{lineno}: expected a JSON object, got {type(value).__name__}")
            seen = True
            yield Record(file, lineno, value)
    if not seen:
        raise ConfigError(f"data.path: {file} holds no records (no non-blank line); delete it or fill it")


def _parquet(file: Path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
        from pyarrow import ArrowException
    except ImportError:
        raise ConfigError(f"data.path: {file} is a .parquet file, which needs pyarrow: pip install pyarrow") from None
    try:
        reader = pq.ParquetFile(file)
    except (ArrowException, OSError) as e:
        raise ConfigError(f"data.path: {file} is not a readable parquet file ({e})") from None
    if reader.metadata.num_rows == 0:
        raise ConfigError(f"data.path: {file} holds no records (0 rows); delete it or fill it")
    row = 0
    try:
        for batch in reader.iter_batches(batch_size=_PARQUET_BATCH):
            for value in batch.to_pylist():
                row += 1
                yield Record(file, row, value)
    except (ArrowException, OSError) as e:
        raise ConfigError(f"data.path: {file} row {row + 1} cannot be read ({e})") from None


def _arrow(file: Path) -> Iterator[Record]:
    """An Arrow stream file, as `datasets`' save_to_disk writes its shards."""
    try:
        import pyarrow as pa
    except ImportError:
        raise ConfigError(f"data.path: {file} is an .arrow file, which needs pyarrow: pip install pyarrow") from None
    row = 0
    try:
        with pa.memory_map(str(file)) as source:
            for batch in pa.ipc.open_stream(source):
                for value in batch.to_pylist():
                    row += 1
                    yield Record(file, row, value)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"data.path: {file} row {row + 1} cannot be read as an Arrow stream ({e})") from None
    if row == 0:
        raise ConfigError(f"data.path: {file} holds no records (0 rows); delete it or fill it")
