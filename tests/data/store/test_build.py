"""The store's writer: a document longer than the writer's buffer (FLUSH_TOKENS, made 5 tokens here) is
appended in parts, its ids, loss mask and offsets the same as the in-memory corpus reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcompose.data import config_tokenizer, iter_documents
from cpcompose.data.store import build, source_store
from tests.support.hf_data import write_jsonl
from tests.support.token_stores import store_config


@pytest.mark.parametrize("fmt", ["text", "completion"])
def test_documents_longer_than_the_buffer_are_written_whole(tmp_path: Path, monkeypatch, fmt: str) -> None:
    monkeypatch.setattr(build, "FLUSH_TOKENS", 5)
    texts = ["ab", "a longer document of many buffers", "xyz", "", "0123456789" * 3]
    records = ([{"text": t} for t in texts] if fmt == "text" else
               [{"prompt": t[: len(t) // 2], "completion": t[len(t) // 2 :] + "!"} for t in texts])
    data = write_jsonl(tmp_path / "d.jsonl", records)
    cfg = store_config(data, tmp_path / "s", f"--data.format={fmt}", seq_len=64)
    store, _ = source_store(cfg.data.path, cfg.data, config_tokenizer(cfg), store_dir=tmp_path / "s", wait_s=5)
    docs = list(iter_documents(cfg, config_tokenizer(cfg)))
    assert store.num_docs == len(docs) == len(texts)
    for d, doc in enumerate(docs):
        a, b = int(store.offsets[d]), int(store.offsets[d + 1])
        assert store.tokens[a:b].tolist() == doc.ids
        if fmt == "completion":
            assert store.trained is not None and store.trained[a:b].astype(bool).tolist() == doc.trained
