"""What a run trains on, in the banner and the dry run: source, files, format, tokenizer, documents, tokens, epochs.

`describe_data` takes a `DataSummary`, whoever fills it: `summarize_data` reads the files here (every
record of a corpus up to the pre-launch scan's size, `FULL_SCAN_BYTES`; a larger one is not counted
here and says so); a token store that knows its counts can hand its own summary to `describe_data`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from cpcompose.config import ConfigError, JobConfig
from cpcompose.data import config_tokenizer, data_files, iter_documents, tokenizer_choice
from cpcompose.data.corpus import FULL_SCAN_BYTES
from cpcompose.data.store import cached_store_folder, source_tables, store_dir, store_mixture, uses_store
from cpcompose.data.store.manifest import is_store
from cpcompose.data.store.summary import counted

__all__ = ["DataSummary", "data_lines", "describe_data", "summarize_data"]


@dataclass(frozen=True)
class DataSummary:
    """A dataset as the banner shows it."""

    source: str
    """What it is: "synthetic copy task", "text files", ..."""
    files: tuple[str, ...] = ()
    format: str | None = None
    """data.format (text, completion, chat), or None for generated data."""
    tokenizer: str | None = None
    """Where the tokenizer comes from (a folder, a file, "byte-level"), or None for generated ids."""
    documents: int | None = None
    """None: not counted (say why in `note`)."""
    tokens: int | None = None
    note: str | None = None


def summarize_data(config: JobConfig) -> DataSummary:
    """The configured data, its documents and tokens counted when the corpus is small enough to read here.

    Raises:
        ConfigError: a tokenizer or a file that does not load (what the pre-launch data check raises).
    """
    d = config.data
    if d.source == "synthetic":
        what = f"synthetic {d.task} task ({d.num_symbols} symbols, generated on the fly: no files, no epochs)"
        return DataSummary(source=what)
    files = data_files(d.path or "")
    choice = tokenizer_choice(config)
    tokenizer = f"{choice.path} ({choice.key})" if choice.path else "byte-level"
    size = sum(f.stat().st_size for f in files)
    base = DataSummary(source=f"{d.source} files at {d.path}", files=tuple(f.name for f in files), format=d.format,
                       tokenizer=tokenizer)
    if size > FULL_SCAN_BYTES:
        return replace(base, note=f"{size / 2**20:.0f} MiB: documents and tokens are counted by the ranks, not here")
    documents = tokens = 0
    for doc in iter_documents(config, config_tokenizer(config)):
        documents += 1
        tokens += len(doc.ids)
    return replace(base, documents=documents, tokens=tokens)


def describe_data(summary: DataSummary, config: JobConfig) -> list[str]:
    """The banner's and the dry run's data lines."""
    t = config.training
    parts = [summary.source]
    if summary.files:
        shown = ", ".join(summary.files[:3]) + (f" and {len(summary.files) - 3} more" if len(summary.files) > 3 else "")
        parts.append(f"{counted(len(summary.files), 'file')} ({shown})")
    if summary.format is not None:
        packed = ", packed" if config.data.pack else ""
        parts.append(f"format {summary.format}{packed}")
    if summary.tokenizer is not None:
        parts.append(f"tokenizer {summary.tokenizer}")
    lines = ["  data: " + "; ".join(parts)]
    if summary.documents is not None and summary.tokens is not None:
        trained = t.steps * t.batch_size * t.seq_len
        epochs = f"{trained / summary.tokens:.2f}" if summary.tokens else "-"
        lines.append(f"  data: {counted(summary.documents, 'document')}, {counted(summary.tokens, 'token')}; "
                     f"{counted(t.steps, 'step')} x {t.batch_size} x {counted(t.seq_len, 'token')} = "
                     f"{counted(epochs, 'epoch')} at this length")
    if summary.note:
        lines.append(f"  data: {summary.note}")
    return lines


def data_lines(config: JobConfig, lengths_png: Path | None = None, notes: Sequence[str] = ()) -> list[str]:
    """`describe_data(summarize_data(config))`, or the reason the data cannot be read here (a dry run before the
    data is in place). Token stores report themselves: per source its documents, tokens, share of the mixture and
    epochs in this run (and, given ``lengths_png``, the length histogram drawn there); read from the stores, which
    the pre-launch check has built, never by tokenizing again. ``notes``: what that check said it did (each store
    reused, built or rebuilt: :func:`cpcompose.data.build_token_stores`), shown after them."""
    try:
        if uses_store(config):
            return _store_lines(config, lengths_png) + [f"  {note}" for note in notes]
        lines = describe_data(summarize_data(config), config)
        if config.data.source == "text":
            lines.append("  data: tokenized in memory by every rank at every start (data.store = false)")
        return lines
    except ConfigError as e:
        return [f"  data: not read here ({e})"]


def _store_lines(config: JobConfig, lengths_png: Path | None) -> list[str]:
    d, t = config.data, config.training
    root = store_dir(d)
    assert root is not None  # uses_store: data.store is on
    for table in source_tables(config):
        path = Path(table["path"])
        if not is_store(path) and not is_store(cached_store_folder(path, d, root)):
            # A dry run before the first launch: building is the launch's work (or the build script's); the files
            # are counted here as without a store (all of a corpus up to FULL_SCAN_BYTES).
            unbuilt = [f"  data: the token store of {path} is not built yet: the launch builds it in {root} before "
                       "any rank starts (or build it ahead: python -m cpcompose.data.build_token_store)"]
            return (describe_data(summarize_data(config), config) if not d.sources else []) + unbuilt
    mixture = store_mixture(config, config_tokenizer(config), emit=None)
    samples = t.steps * t.batch_size  # batch_size counts every dp rank and micro-step
    return [f"  {line}" for line in mixture.report(samples, lengths_png)]
