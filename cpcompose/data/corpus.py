"""data.source = "text": the files, read and tokenized into a source, or scanned before launch.

Both paths run the same reading and checking code (:func:`iter_documents`), so a bad record gives the same
ConfigError before launch and, for records the pre-launch scan did not reach, in the ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from cpcompose.config import ConfigError, JobConfig
from cpcompose.data.batch import SampleSource
from cpcompose.data.encoding import encoded_documents
from cpcompose.data.formats import Document, RecordReader, record_too_long
from cpcompose.data.records import data_files, iter_records
from cpcompose.data.store.manifest import is_store
from cpcompose.data.store.sources import store_mixture, uses_store
from cpcompose.data.supervised import SupervisedSource
from cpcompose.data.text import TextSource, short_corpus_error
from cpcompose.data.tokenizer import Tokenizer

__all__ = ["FULL_SCAN_BYTES", "SAMPLE_RECORDS", "build_corpus_source", "build_corpus_stores", "iter_documents"]

FULL_SCAN_BYTES = 8 << 20
"""Data up to this size is read and tokenized whole before launch: a few seconds at the 1-2 MiB/s of text that a
BPE tokenizer or a chat template managed on two shared CPU cores (measured; more cores encode batches faster)."""
SAMPLE_RECORDS = 1000
"""Above it, the pre-launch scan checks this many records of each file; the ranks check the rest as they load."""


def iter_documents(config: JobConfig, tokenizer: Tokenizer, *, limit_per_file: int | None = None) -> Iterator[Document]:
    """The documents of ``config.data`` in order, each checked against its format and, for records, against
    training.seq_len (too long: an error, or truncated with data.truncate; nothing left to train: dropped).

    Raises:
        ConfigError: naming the file, the line or row, and the key to change.
    """
    reader = RecordReader(config.data, tokenizer)
    records = iter_records(data_files(config.data.path or ""), limit_per_file=limit_per_file)
    for _, doc in encoded_documents(reader, records):
        if doc.trained is None or (doc := fit_record(doc, config)) is not None:
            yield doc


def fit_record(doc: Document, config: JobConfig) -> Document | None:
    """A record as long as a row at most: the policy of data.truncate."""
    seq_len = config.training.seq_len
    assert doc.trained is not None
    if len(doc.ids) > seq_len:
        if not config.data.truncate:
            raise record_too_long(doc.where, len(doc.ids), seq_len)
        doc = replace(doc, ids=doc.ids[:seq_len], trained=doc.trained[:seq_len])
    return doc if any(doc.trained[1:]) else None  # the first id is predicted by nothing in its document


def build_corpus_source(config: JobConfig, tokenizer: Tokenizer) -> SampleSource:
    """The whole corpus, tokenized, as text windows (format text) or packed rows of records.

    Raises:
        ConfigError: a bad file or record, a corpus shorter than one window, or no record to train on.
    """
    d, t = config.data, config.training
    if uses_store(config):
        return store_mixture(config, tokenizer)
    _refuse_a_store_in_memory(config)
    docs = iter_documents(config, tokenizer)
    if d.format == "text":
        return TextSource.from_documents((doc.ids for doc in docs), seq_len=t.seq_len, seed=config.job.seed,
                                         pack=bool(d.pack), path=d.path)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    records = [(doc.ids, doc.trained or []) for doc in docs]
    if not records:
        raise _nothing_to_train(config)
    return SupervisedSource.from_documents(records, seq_len=t.seq_len, pad_id=pad, seed=config.job.seed)


def build_corpus_stores(config: JobConfig, tokenizer: Tokenizer) -> list[str]:
    """The pre-launch build of the token stores (or, in memory, the check of the records). Through token stores (the default): every store and sample index is opened, or
    built here, once, before any rank starts (every record read). In memory (data.store = false): every record
    when the data is at most FULL_SCAN_BYTES, else the first SAMPLE_RECORDS of each file (every file is still
    opened, so an unreadable or empty one is caught); text is then read on until it holds one window, so a short
    corpus is always caught here.

    Returns:
        A line per source saying whether its token store was reused (and where), built or rebuilt (and why),
        for the launch banner; none in memory.
    Raises:
        ConfigError: what :func:`build_corpus_source` would raise (for the records scanned).
    """
    d, seq_len = config.data, config.training.seq_len
    if uses_store(config):
        return [outcome.line() for outcome in store_mixture(config, tokenizer).outcomes]
    _refuse_a_store_in_memory(config)
    size = sum(f.stat().st_size for f in data_files(d.path or ""))
    limit = None if size <= FULL_SCAN_BYTES else SAMPLE_RECORDS
    count = sum(len(doc.ids) for doc in iter_documents(config, tokenizer, limit_per_file=limit))
    if d.format == "text" and count < seq_len + 1 and limit is not None:
        count = 0
        for doc in iter_documents(config, tokenizer):
            count += len(doc.ids)
            if count > seq_len:
                break
    if d.format == "text" and count < seq_len + 1:
        raise short_corpus_error(count, seq_len, d.path)
    if d.format != "text" and count == 0 and limit is None:
        raise _nothing_to_train(config)
    return []


def _refuse_a_store_in_memory(config: JobConfig) -> None:
    """data.store = false reads files; a token store has none to read (it may have been copied without them)."""
    if config.data.path is not None and is_store(Path(config.data.path)):
        raise ConfigError(f"data.store: false tokenizes files in memory, but data.path {config.data.path} is a "
                          "token store (tokenized already); remove data.store = false")


def _nothing_to_train(config: JobConfig) -> ConfigError:
    return ConfigError(f"data.path: no record in {config.data.path} has a token to train on within its first "
                       f"training.seq_len = {config.training.seq_len} tokens; raise training.seq_len")
