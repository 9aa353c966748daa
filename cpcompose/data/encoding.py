"""Records to documents in tokenizer batches: the one loop that both the in-memory corpus and the token store's
builder read their data through, so both check every record the same way."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from cpcompose.data.formats import Document, RecordReader
from cpcompose.data.records import Record

__all__ = ["ENCODE_BATCH", "encoded_documents"]

ENCODE_BATCH = 256
"""Texts per tokenizer call (a `tokenizers` batch is encoded on every core)."""


def encoded_documents(reader: RecordReader, records: Iterable[Record], *,
                      batch: int = ENCODE_BATCH) -> Iterator[tuple[Record, Document]]:
    """Each record with its document, in order, the texts of ``batch`` records encoded in one call.

    Raises:
        ConfigError: a record that does not fit the format (naming its file and line or row).
    """
    pending: list[tuple[Record, list[str]]] = []
    for record in records:
        pending.append((record, reader.texts(record)))
        if len(pending) == batch:
            yield from _encode(reader, pending)
            pending = []
    yield from _encode(reader, pending)


def _encode(reader: RecordReader, pending: list[tuple[Record, list[str]]]) -> Iterator[tuple[Record, Document]]:
    flat = [t for _, texts in pending for t in texts]
    encoded = reader.tokenizer.encode_batch(flat) if flat else []
    at = 0
    for record, texts in pending:
        yield record, reader.document(record, encoded[at : at + len(texts)])
        at += len(texts)
