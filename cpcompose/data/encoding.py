"""Records to documents in tokenizer batches: the one loop that both the in-memory corpus and the token store's
builder read their data through, so both check every record the same way.

Long texts are encoded in pieces (:mod:`cpcompose.data.pieces`, the same ids), and a batch is sent once it holds
``CALL_CHARS`` of text, so the tokenizer's memory does not follow the longest document or the batch."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator

from cpcompose.data.formats import Document, RecordReader
from cpcompose.data.pieces import CALL_CHARS, PIECE_CHARS, encode_texts
from cpcompose.data.records import Record

__all__ = ["ENCODE_BATCH", "encoded_documents"]

ENCODE_BATCH = 256
"""Records encoded together (a `tokenizers` batch is encoded on every core); a batch also ends at CALL_CHARS
characters of text."""

Warn = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def encoded_documents(reader: RecordReader, records: Iterable[Record], *, batch: int = ENCODE_BATCH,
                      warn: Warn = _stderr, piece_chars: int = PIECE_CHARS) -> Iterator[tuple[Record, Document]]:
    """Each record with its document, in order, the texts of up to ``batch`` records (and at most about
    CALL_CHARS characters) encoded in one call. ``warn`` gets a line naming the record when a long text could
    not be cut into pieces (its ids are still exact; its encoding's memory follows its length).
    ``piece_chars``: see :func:`cpcompose.data.pieces.encode_texts` (tests give short pieces).

    Raises:
        ConfigError: a record that does not fit the format (naming its file and line or row).
    """
    pending: list[tuple[Record, list[str]]] = []
    chars = 0
    for record in records:
        texts = reader.texts(record)
        pending.append((record, texts))
        chars += sum(map(len, texts))
        if len(pending) == batch or chars >= CALL_CHARS:
            yield from _encode(reader, pending, warn, piece_chars)
            pending, chars = [], 0
    yield from _encode(reader, pending, warn, piece_chars)


def _encode(reader: RecordReader, pending: list[tuple[Record, list[str]]],
            warn: Warn, piece_chars: int) -> Iterator[tuple[Record, Document]]:
    flat = [t for _, texts in pending for t in texts]
    owner = [record for record, texts in pending for _ in texts]

    def uncut(i: int, longest: int) -> None:
        warn(f"warning: data.path: {owner[i].where}: {len(flat[i]):,} characters tokenized with a piece of "
             f"{longest:,} at once (no cut between words there gives this tokenizer's whole-text ids); the ids are "
             "exact, but the tokenizer holds ~300 bytes a token of a piece: split such texts at line breaks")

    encoded = encode_texts(reader.tokenizer, flat, uncut=uncut, piece_chars=piece_chars) if flat else []
    at = 0
    for record, texts in pending:
        yield record, reader.document(record, encoded[at : at + len(texts)])
        at += len(texts)
