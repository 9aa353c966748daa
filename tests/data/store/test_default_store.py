"""Files given as data.path go through a token store by default, kept in the per-user cache; data.store_dir
moves it; data.store = false tokenizes in memory and writes nothing (issue 36, item 5).

The suite's cache is a temporary folder (tests/conftest.py); these tests point it at their own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cpcompose.config import ConfigError, load_config
from cpcompose.data import TextSource, build_data_source, build_token_stores
from cpcompose.data.store import StoreMixture, cached_store_folder, store_dir, user_cache_folder
from tests.support.token_stores import write_documents

CACHE = Path("cpcompose") / "token-stores"


def _config(data: Path, *argv: str):
    return load_config(["--data.source=text", f"--data.path={data}", "--training.seq_len=32",
                        "--training.batch_size=2", *argv])


def test_a_corpus_file_is_stored_once_in_the_user_cache_by_default(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    data = write_documents(tmp_path / "corpus.jsonl", [30, 40, 50])
    cfg = _config(data)
    root = tmp_path / "xdg" / CACHE
    folder = cached_store_folder(data, cfg.data, root)
    assert store_dir(cfg.data) == root
    (built,) = build_token_stores(cfg)  # the pre-launch check builds it ...
    assert built.startswith(f"token store of {data}: built {folder} in "), built
    assert build_token_stores(cfg)[0].startswith(f"token store of {data}: reused {folder} (built ")  # ... a second start not
    loader = build_data_source(cfg, dp_rank=0, dp_size=1)  # what each rank does: memory-maps it
    assert isinstance(loader.source, StoreMixture) and loader.source.stores[0].folder == folder
    assert sorted(p.name for p in root.iterdir()) == [folder.name]  # and no lock file stays


def test_store_dir_moves_the_stores_and_store_false_reads_in_memory_writing_nothing(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    data = write_documents(tmp_path / "corpus.jsonl", [30, 40, 50])
    assert store_dir(_config(data, f"--data.store_dir={tmp_path / 'mine'}").data) == tmp_path / "mine"
    memory = _config(data, "--data.store=false")
    assert store_dir(memory.data) is None and build_token_stores(memory) == []
    assert isinstance(build_data_source(memory, dp_rank=0, dp_size=1).source, TextSource)
    assert not (tmp_path / "xdg").exists()


def test_the_cache_is_under_home_unless_xdg_cache_home_is_absolute(tmp_path: Path, monkeypatch) -> None:
    """As the XDG specification says: an empty or relative XDG_CACHE_HOME is ignored."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for value in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert user_cache_folder() == tmp_path / "home" / ".cache" / CACHE
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert user_cache_folder() == tmp_path / "home" / ".cache" / CACHE
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_folder() == tmp_path / "xdg" / CACHE


def test_store_false_refuses_a_prebuilt_store_and_an_unwritable_cache_names_store_dir(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    data = write_documents(tmp_path / "corpus.jsonl", [30, 40, 50])
    build_token_stores(_config(data, f"--data.store_dir={tmp_path / 's'}"))
    store = cached_store_folder(data, _config(data).data, tmp_path / "s")
    with pytest.raises(ConfigError, match=rf"^data.store: false tokenizes files in memory, but data.path {store} is "
                                          r"a token store \(tokenized already\); remove data.store = false$"):
        build_token_stores(_config(store, "--data.store=false"))
    (tmp_path / "xdg").write_text("a file where the cache folder should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(ConfigError, match=r"^data.store_dir: cannot create .* \(Not a directory\) to build the token "
                                          r"store there; set data.store_dir to a writable folder, or data.store = "
                                          r"false to tokenize in memory$"):
        build_token_stores(_config(data))


def test_the_suite_keeps_its_stores_out_of_the_real_cache(token_store_cache: Path) -> None:
    """Every test, rank and command of the suite sees tests/conftest.py's temporary cache (XDG_CACHE_HOME)."""
    assert user_cache_folder() == token_store_cache / CACHE
    assert os.environ["XDG_CACHE_HOME"] == str(token_store_cache)
