"""The token store of one source: a prebuilt store used as it is, or the cached store of a folder of files,
built on first use and rebuilt (saying why) when a file or the tokenizer changed; and what happened, for the
banner (:class:`StoreOutcome`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cpcompose.config import ConfigError, Data
from cpcompose.data.encoding import encoded_documents
from cpcompose.data.formats import RecordReader
from cpcompose.data.records import data_files, iter_records
from cpcompose.data.store.build import Opener, Progress, token_dtype, write_store
from cpcompose.data.store.index import index_prefix
from cpcompose.data.store.lock import build_lock
from cpcompose.data.store.manifest import (
    file_stamps,
    format_options,
    is_store,
    new_manifest,
    read_manifest,
    stale_reason,
    tokenizer_fingerprint,
)
from cpcompose.data.store.tokens import TokenStore
from cpcompose.data.tokenizer import Tokenizer

__all__ = ["StoreOutcome", "cached_store_folder", "source_store"]


def cached_store_folder(path: Path, data: Data, store_dir: Path) -> Path:
    """Where the store of the files at ``path`` is kept: named after them and the record options."""
    key = json.dumps([str(path.resolve()), format_options(data)], sort_keys=True)
    return store_dir / f"{path.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class StoreOutcome:
    """How this process came by the store of one source, as the launch banner says it."""

    source: str
    """The source as configured (data.path or a [[data.sources]] path)."""
    folder: Path
    action: Literal["prebuilt", "reused", "built", "rebuilt"]
    """prebuilt: the source is a store, read as it is; reused: a store that matched its files; built: made
    now, there was none; rebuilt: made now, replacing one that no longer matched (``reason`` says why)."""
    reason: str | None = None
    seconds: float | None = None
    """built / rebuilt: how long the build took."""
    built_unix: float | None = None
    """reused / prebuilt: when the store was built."""
    by_other: bool = False
    """built / rebuilt by another process while this one waited for it (usually another rank of this launch)."""

    def line(self) -> str:
        """One line: ``token store of SOURCE: reused FOLDER (built ...)`` and the like."""
        when = "" if self.built_unix is None else time.strftime(" (built %Y-%m-%d %H:%M:%S)",
                                                                 time.localtime(self.built_unix))
        if self.action == "prebuilt":
            return f"token store {self.folder}: prebuilt, read as it is{when}"
        if self.action == "reused":
            return f"token store of {self.source}: reused {self.folder}{when}"
        took = "" if self.seconds is None else f" in {self.seconds:.1f} s"
        who = " by another process" if self.by_other else ""
        why = "" if self.reason is None else f": {self.reason}"
        return f"token store of {self.source}: {self.action} {self.folder}{took}{who}{why}"


def source_store(path: str, data: Data, tokenizer: Tokenizer, *, store_dir: Path | None, wait_s: float,
                 emit: Callable[[str], None] | None = None,
                 opener: Opener | None = None) -> tuple[TokenStore, StoreOutcome]:
    """The store for the source ``path``: the store itself when ``path`` is one (built ahead of time, perhaps on
    another machine), else the files' store in ``store_dir``, built or rebuilt here when needed (one process
    builds, the others wait up to ``wait_s``); and how it came about.

    Raises:
        ConfigError: a prebuilt store from another tokenizer or format, a foreign or truncated store, a source
            file deleted since the build, a bad record (naming file and line), or a failed write.
    """
    source = Path(path)
    fingerprint, options = tokenizer_fingerprint(tokenizer), format_options(data)
    if is_store(source):
        store = TokenStore(source)
        if store.manifest["tokenizer"] != fingerprint:
            raise ConfigError(f"data.path: the token store {source} was built with another tokenizer than this run's "
                              "(data.tokenizer / model.path); rebuild it with this one, or use that tokenizer")
        if store.manifest["options"] != options:
            raise ConfigError(f"data.format: the token store {source} holds {store.manifest['options']}, this run "
                              f"reads {options}; rebuild it, or set the data options it was built with")
        return store, StoreOutcome(path, source, "prebuilt", built_unix=store.manifest.get("built_unix"))
    files = data_files(source)
    if store_dir is None:
        raise ConfigError(f"data.store: the files at {source} are read through a token store; remove data.store = "
                          "false, or point data.path at the files (data.store = false reads them in memory)")
    folder = cached_store_folder(source, data, store_dir)
    try:  # the common case, without waiting for the lock
        if is_store(folder) and stale_reason(read_manifest(folder), fingerprint=fingerprint, options=options,
                                             files=files, store=folder) is None:
            return _opened(path, folder, "reused")
    except ConfigError:  # perhaps replaced while read: decided again under the lock, which raises what persists
        pass
    with build_lock(folder, timeout_s=wait_s):
        reason = None
        if is_store(folder):  # built (or changed again) while this process waited
            reason = stale_reason(read_manifest(folder), fingerprint=fingerprint, options=options, files=files,
                                  store=folder)
            if reason is None:
                return _opened(path, folder, "built")
            if emit is not None:
                emit(f"token store {folder}: rebuilding, {reason}")
            aside = folder.with_name(f".{folder.name}.stale-{os.getpid()}")
            os.replace(folder, aside)  # gone from its name at once: no reader sees it half deleted
            shutil.rmtree(aside)
            for index in folder.parent.glob(f"{index_prefix(folder)}*"):  # the old store's rows (not their locks)
                if index.is_dir():
                    shutil.rmtree(index, ignore_errors=True)
        _build(folder, source, files, data, tokenizer, fingerprint, options, reason, emit, opener)
    store = TokenStore(folder)
    return store, StoreOutcome(path, folder, "built" if reason is None else "rebuilt", reason,
                               seconds=store.manifest["build_seconds"])


def _opened(path: str, folder: Path, found: Literal["reused", "built"]) -> tuple[TokenStore, StoreOutcome]:
    """A finished store opened without building it: ``found`` "built" when another process built it while this
    one waited for the lock (its manifest says why and how long), else "reused"."""
    store = TokenStore(folder)
    m = store.manifest
    if found == "reused":
        return store, StoreOutcome(path, folder, "reused", built_unix=m.get("built_unix"))
    reason = m.get("build_reason")
    return store, StoreOutcome(path, folder, "rebuilt" if reason else "built", reason,
                               seconds=m.get("build_seconds"), by_other=True)


def _build(folder: Path, source: Path, files: list[Path], data: Data, tokenizer: Tokenizer, fingerprint: str,
           options: dict, reason: str | None, emit: Callable[[str], None] | None, opener: Opener | None) -> None:
    stamps = file_stamps(files)
    manifest = new_manifest(source=str(source), stamps=stamps, fingerprint=fingerprint, options=options,
                            tokenizer=tokenizer)
    manifest["build_reason"] = reason  # what replaced an older store, for a process that waited for this one
    reader = RecordReader(data, tokenizer)
    documents = encoded_documents(reader, iter_records(files), batch=1024)
    progress = Progress(str(source), sum(s["size"] for s in stamps), emit)
    write_store(folder, documents, manifest, files=files, dtype=token_dtype(tokenizer.vocab_size),
                progress=progress, opener=opener)
