"""A source's token store: built once and reused, rebuilt (saying why) when a file or the tokenizer changes,
built by one process while the others wait, and a prebuilt store used as it is."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from cpcompose.config import ConfigError
from cpcompose.data import ByteTokenizer, build_data_source, build_token_stores, config_tokenizer, iter_documents
from cpcompose.data.store import TokenStore, cached_store_folder, source_store, store_mixture
from cpcompose.data.store.build import token_dtype
from cpcompose.data.store.lock import build_lock
from tests.support.hf_data import chat_records, tiny_tokenizer_folder, write_jsonl
from tests.support.token_stores import store_config, write_documents


def _open(cfg, lines: list[str]) -> TokenStore:
    store, outcome = source_store(cfg.data.path, cfg.data, config_tokenizer(cfg), store_dir=Path(cfg.data.store_dir),
                                  wait_s=5, emit=lines.append)
    lines.append(outcome.line())
    return store


def test_a_store_is_built_once_reused_and_rebuilt_when_a_source_changes(tmp_path: Path) -> None:
    """Each time saying so (the banner's line), and leaving no lock file behind."""
    data = write_documents(tmp_path / "d" / "a.jsonl", [10, 20, 30])
    cfg, lines = store_config(data.parent, tmp_path / "s"), []
    folder = cached_store_folder(data.parent, cfg.data, tmp_path / "s")
    first = _open(cfg, lines)
    assert lines[-1].startswith(f"token store of {data.parent}: built {folder} in ") and lines[-1].endswith(" s")
    assert first.num_docs == 3 and first.lengths().tolist() == [12, 22, 32]  # BOS text EOS
    assert first.tokens.dtype == np.uint16 and first.trained is None
    docs = [d.ids for d in iter_documents(cfg, ByteTokenizer())]  # what the in-memory corpus reads
    assert [first.tokens[a:b].tolist() for a, b in zip(first.offsets[:-1], first.offsets[1:])] == docs
    built = first.manifest["built_unix"]
    packed = store_config(data.parent, tmp_path / "s", "--data.pack=true")
    store_mixture(packed, config_tokenizer(packed), emit=None)  # a sample index of this build
    assert len([p for p in (tmp_path / "s").glob("*.index-*") if p.is_dir()]) == 1
    assert _open(cfg, lines).manifest["built_unix"] == built and not any("rebuilding" in x for x in lines)
    assert re.fullmatch(rf"token store of {data.parent}: reused {folder} \(built \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\)",
                        lines[-1]), lines[-1]
    write_documents(data, [10, 20, 31])
    os.utime(data, ns=(time.time_ns(), time.time_ns() + 10**9))  # a later mtime even on a coarse clock
    again = _open(cfg, lines)
    assert again.lengths().tolist() == [12, 22, 33] and again.manifest["built_unix"] != built
    assert any(f"rebuilding, {data.resolve()} changed" in x for x in lines)
    assert lines[-1].startswith(f"token store of {data.parent}: rebuilt {folder} in ")
    assert lines[-1].endswith(f" s: {data.resolve()} changed"), lines[-1]
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [folder.name]  # the old one, its index, locks gone


def test_another_tokenizer_rebuilds_the_cached_store_and_says_so(tmp_path: Path) -> None:
    data = write_documents(tmp_path / "d" / "a.jsonl", [10, 20])
    lines: list[str] = []
    _open(store_config(data, tmp_path / "s"), lines)
    tok = tiny_tokenizer_folder()
    other = _open(store_config(data, tmp_path / "s", f"--data.tokenizer={tok}", "--model.vocab_size=320"), lines)
    assert any("rebuilding, the tokenizer changed" in x for x in lines)
    assert lines[-1].endswith(": the tokenizer changed"), lines[-1]
    assert other.manifest["vocab_size"] == 320 and other.tokens.dtype == np.uint16


def test_wide_vocabularies_get_32_bit_ids() -> None:
    assert token_dtype(1 << 16) == np.uint16 and token_dtype((1 << 16) + 1) == np.uint32


def test_chat_records_keep_their_loss_mask_in_the_store(tmp_path: Path) -> None:
    tok = tiny_tokenizer_folder()
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(12, seed=4))
    cfg = store_config(data, tmp_path / "s", "--data.format=chat", f"--data.tokenizer={tok}",
                       "--model.vocab_size=320", seq_len=256)
    store = _open(cfg, [])
    docs = list(iter_documents(cfg, config_tokenizer(cfg)))
    assert store.trained is not None and store.num_docs == len(docs) == 12
    for d, doc in enumerate(docs):
        a, b = int(store.offsets[d]), int(store.offsets[d + 1])
        assert store.tokens[a:b].tolist() == doc.ids and store.trained[a:b].astype(bool).tolist() == doc.trained
    batch = next(build_data_source(cfg, dp_rank=0, dp_size=1))
    assert batch.cu_seqlens is not None and (batch.labels != -100).any()


def test_a_prebuilt_store_is_read_without_its_sources(tmp_path: Path) -> None:
    data = write_documents(tmp_path / "d" / "a.jsonl", [50, 60, 70])
    cfg = store_config(data, tmp_path / "s")
    folder = cached_store_folder(data, cfg.data, tmp_path / "s")
    (note,) = build_token_stores(cfg)  # the pre-launch check builds it
    assert note == f"token store of {data}: built {folder} in {TokenStore(folder).manifest['build_seconds']:.1f} s"
    moved = folder.rename(tmp_path / "copied-store")
    data.unlink()  # the sources stayed on the machine that built it
    (note,) = build_token_stores(store_config(moved, tmp_path / "other"))
    assert note.startswith(f"token store {moved}: prebuilt, read as it is (built "), note
    loader = build_data_source(store_config(moved, tmp_path / "other"), dp_rank=0, dp_size=1)
    assert next(loader).input_ids.shape == (4, 32)


def test_a_process_waits_for_the_builder_and_gives_up_after_the_timeout(tmp_path: Path) -> None:
    data = write_documents(tmp_path / "d" / "a.jsonl", [10])
    cfg = store_config(data, tmp_path / "s")
    folder = cached_store_folder(data, cfg.data, tmp_path / "s")
    with build_lock(folder, timeout_s=1):  # another builder holds it (flock: per open file, so this process too)
        with pytest.raises(ConfigError, match=r"^data.store_wait_s: waited 0.3 s for another process to build"):
            source_store(str(data), cfg.data, ByteTokenizer(), store_dir=tmp_path / "s", wait_s=0.3)
    assert source_store(str(data), cfg.data, ByteTokenizer(), store_dir=tmp_path / "s", wait_s=0.3)[0].num_docs == 1


def _build_in_child(cfg, barrier) -> tuple[float, int, str, bool]:
    barrier.wait(timeout=60)
    mixture = store_mixture(cfg, config_tokenizer(cfg), emit=None)
    outcome = mixture.outcomes[0]
    return mixture.stores[0].manifest["built_unix"], mixture.epoch_length, outcome.action, outcome.by_other


def test_processes_starting_together_build_the_store_once(tmp_path: Path) -> None:
    data = write_documents(tmp_path / "d" / "a.jsonl", [200] * 2000)  # long enough that the starts overlap
    cfg = store_config(data, tmp_path / "s", "--data.pack=true")
    ctx = mp.get_context("fork")
    barrier = ctx.Manager().Barrier(3)
    with ctx.Pool(3) as pool:
        pending = [pool.apply_async(_build_in_child, (cfg, barrier)) for _ in range(3)]
        results = [p.get(timeout=120) for p in pending]
    assert len({r[:2] for r in results}) == 1  # one build (a second would have replaced it, with a later time)
    said = sorted(r[2:] for r in results)  # the builder says built; the others waited for it, or came after it
    assert said[0] == ("built", False) and all(s in (("built", True), ("reused", False)) for s in said[1:]), said
    assert leftovers(tmp_path / "s") == sorted([cached_store_folder(data, cfg.data, tmp_path / "s").name,
                                                next(p.name for p in (tmp_path / "s").glob("*.index-*") if p.is_dir())])


def leftovers(store_dir: Path) -> list[str]:
    """Everything in the stores' folder: no lock file stays once the builds are done."""
    return sorted(p.name for p in store_dir.iterdir())


def test_the_progress_line_gives_text_read_tokens_per_second_and_time_left() -> None:
    from cpcompose.data.store.build import Progress

    lines: list[str] = []
    progress = Progress("data/web", 4 << 20, lines.append, every_s=0.0)
    progress.update(1 << 20, 300_000)
    progress.update(4 << 20, 1_200_000, final=True)
    assert lines[0].startswith("token store data/web: 1.0 of 4.0 MiB of text, 300,000 tokens, ")
    assert " tokens/s, about " in lines[0] and lines[0].endswith(" s left")
    assert lines[1].startswith("token store data/web: 4.0 of 4.0 MiB of text, 1,200,000 tokens, ")
    assert " done in " in lines[1]
    Progress("quiet", 1, None).update(1, 1, final=True)  # no emitter: nothing printed, nothing raised
    short: list[str] = []
    Progress("short", 1, short.append, every_s=60.0).update(1, 1, final=True)
    assert short == []  # a build that said nothing while it ran says nothing at its end (the banner does)
