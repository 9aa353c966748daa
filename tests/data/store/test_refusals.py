"""Bad input to a token store: a truncated or foreign store, a store from another tokenizer, a source deleted
after the build, a full disk during the build, a bad record in the middle of a file. Each is a one-line
ConfigError naming the file (and line), raised by the pre-launch check (before any rank or collective), and
nothing half-built is left where a later run would use it."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import IO

import pytest

from cpcompose.config import ConfigError
from cpcompose.data import build_data_source, build_token_stores
from cpcompose.data.store import TokenStore, cached_store_folder
from cpcompose.data.store.sources import store_mixture
from cpcompose.data import config_tokenizer
from tests.support.hf_data import tiny_tokenizer_folder
from tests.support.token_stores import store_config, write_documents


def refused(cfg, pattern: str) -> str:
    """The pre-launch check's one-line message, matched against ``pattern``."""
    with pytest.raises(ConfigError, match=pattern) as error:
        build_token_stores(cfg)
    assert "\n" not in str(error.value)
    return str(error.value)


def leftovers(store_dir: Path) -> list[str]:
    """What a failed build left in the store folder (its lock file included: none)."""
    return sorted(p.name for p in store_dir.iterdir()) if store_dir.exists() else []


def built(tmp_path: Path, lengths: list[int] = [40, 50, 60]) -> tuple[Path, Path]:
    data = write_documents(tmp_path / "d" / "a.jsonl", lengths)
    cfg = store_config(data.parent, tmp_path / "s")
    build_token_stores(cfg)
    return data, cached_store_folder(data.parent, cfg.data, tmp_path / "s")


def test_a_truncated_store_names_the_short_file(tmp_path: Path) -> None:
    _, folder = built(tmp_path)
    tokens = folder / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-6])  # a copy cut short
    refused(store_config(folder, tmp_path / "t"), rf"^data.path: {tokens} has \d+ bytes, its manifest says \d+ "
                                                   r"\(truncated or altered\)")


def test_a_foreign_folder_with_a_manifest_is_not_read(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "manifest.json").write_text(json.dumps({"name": "some other tool's dataset"}))
    refused(store_config(foreign, tmp_path / "s"), rf"^data.path: {foreign} is not a cpcompose token store")


def test_a_prebuilt_store_from_another_tokenizer_is_refused(tmp_path: Path) -> None:
    _, folder = built(tmp_path)  # byte-level ids
    cfg = store_config(folder, tmp_path / "t", f"--data.tokenizer={tiny_tokenizer_folder()}", "--model.vocab_size=320")
    refused(cfg, rf"^data.path: the token store {folder} was built with another tokenizer")


def test_a_source_deleted_after_the_build_is_named(tmp_path: Path) -> None:
    data = write_documents(tmp_path / "d" / "a.jsonl", [40, 50])
    write_documents(tmp_path / "d" / "b.jsonl", [30])
    cfg = store_config(data.parent, tmp_path / "s")
    build_token_stores(cfg)
    data.unlink()
    folder = cached_store_folder(data.parent, cfg.data, tmp_path / "s")
    refused(cfg, rf"^data.path: {data.resolve()} was deleted after the token store of {data.parent} was built from "
                 rf"it; restore it, or delete {folder} to rebuild it from the files there now$")
    assert TokenStore(folder).num_docs == 3  # the store itself is left as it was


class FullDisk:
    """Opens store files whose writes fail with ENOSPC once ``room`` bytes have been written in all."""

    def __init__(self, room: int) -> None:
        self.room = room

    def __call__(self, path: Path) -> IO[bytes]:
        disk, f = self, open(path, "wb")

        class Writer:
            def write(self, data: bytes) -> int:
                disk.room -= len(data)
                if disk.room < 0:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return f.write(data)

            def __getattr__(self, name: str):
                return getattr(f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                f.close()

        return Writer()  # type: ignore[return-value]


@pytest.mark.parametrize("room", [100, 4000])  # fails in the tokens, or only at the manifest
def test_a_full_disk_during_the_build_leaves_nothing_and_the_next_build_works(tmp_path: Path, room: int) -> None:
    data = write_documents(tmp_path / "d" / "a.jsonl", [1000, 900, 800])  # ~2.7 k ids: 5.4 kB of uint16
    cfg = store_config(data.parent, tmp_path / "s")
    folder = cached_store_folder(data.parent, cfg.data, tmp_path / "s")
    with pytest.raises(ConfigError, match=rf"^data.store_dir: writing the token store {folder} failed \(No space "
                                          r"left on device\);") as error:
        store_mixture(cfg, config_tokenizer(cfg), emit=None, opener=FullDisk(room))
    assert "\n" not in str(error.value) and leftovers(tmp_path / "s") == []
    assert next(build_data_source(cfg, dp_rank=0, dp_size=1)).input_ids.shape == (4, 32)


def test_a_bad_record_in_the_middle_of_a_file_names_its_line_and_leaves_nothing(tmp_path: Path) -> None:
    data = write_documents(tmp_path / "d" / "a.jsonl", [20] * 3000)
    lines = data.read_text().splitlines(keepends=True)
    lines[2345] = '{"text": "cut off\n'
    data.write_text("".join(lines))
    cfg = store_config(data.parent, tmp_path / "s")
    refused(cfg, rf"^data.path: {data}:2346: invalid JSON")
    assert leftovers(tmp_path / "s") == []


def test_a_record_too_long_for_a_row_names_its_line(tmp_path: Path) -> None:
    records = [{"prompt": "q" * 5, "completion": "a" * n} for n in (5, 6, 80, 7)]  # BOS, 5 + n, EOS
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = store_config(data, tmp_path / "s", "--data.format=completion")
    refused(cfg, rf"^training.seq_len: {data}:3: the record has 87 tokens, more than training.seq_len = 32")
    build_token_stores(store_config(data, tmp_path / "s", "--data.format=completion", "--data.truncate=true"))


def test_a_killed_builds_temporary_folder_is_never_read_and_is_cleared(tmp_path: Path) -> None:
    data = write_documents(tmp_path / "d" / "a.jsonl", [40, 50])
    cfg = store_config(data.parent, tmp_path / "s")
    folder = cached_store_folder(data.parent, cfg.data, tmp_path / "s")
    half = folder.with_name(f".{folder.name}.building-999999")  # what a SIGKILLed builder leaves
    half.mkdir(parents=True)
    (half / "tokens.bin").write_bytes(b"\0" * 10)
    (half / "manifest.json").write_text("{}")
    build_token_stores(cfg)
    assert leftovers(tmp_path / "s") == [folder.name] and TokenStore(folder).num_docs == 2
