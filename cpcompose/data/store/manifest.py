"""What a token store records about how it was made, and the checks that decide whether it can be used.

A store's manifest names its version, the source files (size and modification time), the tokenizer's
fingerprint, the record format and its options, and the arrays' lengths. It is written last, inside the
temporary folder that is then renamed, so a folder with a manifest is a complete store.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from cpcompose.config import ConfigError, Data
from cpcompose.data.tokenizer import Tokenizer

__all__ = ["MANIFEST", "VERSION", "file_stamps", "format_options", "is_store", "new_manifest", "read_manifest",
           "stale_reason", "tokenizer_fingerprint"]

MANIFEST = "manifest.json"
VERSION = 1
_KIND = "cpcompose token store"
_PROBE = "Tokenizer probe: naïve café, 東京, emoji 🙂, code `x += 1;`\n\tand </s> <|endoftext|> [INST]"


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A digest of what makes a tokenizer's ids: its kind, vocabulary, special ids, its definition (a `tokenizers`
    JSON when it has one), its chat template, and the ids of a probe text."""
    parts: list[Any] = [type(tokenizer).__name__, tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id,
                        tokenizer.pad_id, tokenizer.encode_batch([_PROBE])]
    backend = getattr(tokenizer, "_plain", None) or getattr(tokenizer, "_tok", None)
    to_str = getattr(backend, "to_str", None)
    if callable(to_str):
        parts.append(to_str())
    parts.append(getattr(tokenizer, "chat_template", None))
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def format_options(data: Data) -> dict[str, Any]:
    """The data.* options that decide a record's document (the format and the keys it reads)."""
    names = {"text": ["text_key"], "completion": ["prompt_key", "completion_key"],
             "chat": ["messages_key", "chat_mask"]}[data.format]
    return {"format": data.format, **{name: getattr(data, name) for name in names}}


def file_stamps(files: list[Path]) -> list[dict[str, Any]]:
    """Each file's path, size and modification time (what tells a changed source)."""
    stamps = []
    for f in files:
        st = f.stat()
        stamps.append({"path": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return stamps


def is_store(folder: Path) -> bool:
    """Whether ``folder`` is a token store (it holds a manifest)."""
    return (folder / MANIFEST).is_file()


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of the store in ``folder``, checked to be one of ours and of this version.

    Raises:
        ConfigError: a missing, unreadable or foreign manifest (naming the file).
    """
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"data.path: {path} is not a readable token-store manifest ({e}); rebuild the store "
                          "(python -m cpcompose.data.build_token_store)") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != _KIND:
        raise ConfigError(f"data.path: {folder} is not a cpcompose token store ({path} was written by something "
                          "else); point data.path at the data files or at a store built by "
                          "python -m cpcompose.data.build_token_store")
    if manifest.get("version") != VERSION:
        raise ConfigError(f"data.path: the token store {folder} has version {manifest.get('version')}, this "
                          f"cpcompose reads version {VERSION}; rebuild it (python -m cpcompose.data.build_token_store)")
    return manifest


def new_manifest(*, source: str, stamps: list[dict[str, Any]], fingerprint: str, options: dict[str, Any],
                 tokenizer: Tokenizer) -> dict[str, Any]:
    """A manifest before its arrays are counted (the builder adds their lengths)."""
    return {"kind": _KIND, "version": VERSION, "source": source, "files": stamps, "tokenizer": fingerprint,
            "options": options, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
            "pad_id": tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id,
            "vocab_size": tokenizer.vocab_size}


def stale_reason(manifest: dict[str, Any], *, fingerprint: str, options: dict[str, Any],
                 files: list[Path] | None, store: Path) -> str | None:
    """Why a store no longer matches its sources, tokenizer or options (a rebuild fixes it), or None.

    ``files`` None skips the source check (a prebuilt store whose sources stayed on another machine).

    Raises:
        ConfigError: a source file recorded in the manifest no longer exists (naming it).
    """
    if manifest["tokenizer"] != fingerprint:
        return "the tokenizer changed"
    if manifest["options"] != options:
        return f"the record options changed ({manifest['options']} -> {options})"
    if files is None:
        return None
    for stamp in manifest["files"]:
        if not Path(stamp["path"]).exists():
            raise ConfigError(f"data.path: {stamp['path']} was deleted after the token store of "
                              f"{manifest['source']} was built from it; restore it, or delete {store} to rebuild "
                              "it from the files there now")
    now = file_stamps(files)
    if now != manifest["files"]:
        before = {s["path"]: s for s in manifest["files"]}
        changed = next((s["path"] for s in now if before.get(s["path"]) != s), None)
        return f"{changed} changed" if changed else "a source file was removed"
    return None
