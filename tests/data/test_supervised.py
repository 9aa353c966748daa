"""Completion and chat records packed whole into rows: boundaries, labels, padding, the seq_len policy,
determinism, dp shares and exact resume; and what the pre-launch scan reads of a large corpus."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import cpcompose.data.corpus as corpus
from cpcompose.config import ConfigError, load_config
from cpcompose.data import IGNORE_INDEX, SupervisedSource, build_data_source, build_token_stores, config_tokenizer, iter_documents
from tests.support.hf_data import chat_records, text_records, tiny_tokenizer_folder, write_jsonl

TOK = tiny_tokenizer_folder()


def config(path: Path, *argv: str, seq_len: int = 128, batch: int = 2):
    """Records tokenized in memory (data.store = false): the source these tests are about."""
    return load_config(["--data.source=text", "--data.store=false", f"--data.path={path}",
                        f"--training.seq_len={seq_len}", f"--training.batch_size={batch}", "--model.vocab_size=320",
                        f"--data.tokenizer={TOK}", *argv])


def test_rows_hold_whole_records_each_a_document_with_its_own_labels(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(30, seed=2))
    cfg = config(data, "--data.format=chat")
    docs = list(iter_documents(cfg, config_tokenizer(cfg)))
    source = build_data_source(cfg, dp_rank=0, dp_size=1).source
    assert isinstance(source, SupervisedSource) and source.num_records == 30 and 1 < source.num_rows < 30
    pad = config_tokenizer(cfg).pad_id
    seen: Counter = Counter()
    for i in range(source.num_rows):  # one epoch: every row once
        sample = source.sample(i)
        cu = sample.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == 128 and all(a < b for a, b in zip(cu, cu[1:]))
        inputs, labels = sample.input_ids.tolist(), sample.labels.tolist()
        for a, b in zip(cu, cu[1:]):
            ids = tuple(inputs[a:b])
            if all(x == pad for x in ids):  # the row's padding: no loss
                assert b == 128 and all(x == IGNORE_INDEX for x in labels[a:b])
                continue
            seen[ids] += 1
            assert labels[b - 1] == IGNORE_INDEX  # nothing predicts across a record
            doc = next(d for d in docs if tuple(d.ids) == ids)
            for t in range(a, b - 1):
                assert labels[t] == (inputs[t + 1] if doc.trained[t + 1 - a] else IGNORE_INDEX)
    assert seen == Counter(tuple(d.ids) for d in docs)  # each record exactly once per epoch, never cut


def test_record_rows_are_deterministic_dp_sharded_and_resume_exactly(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(30, seed=3))
    cfg = config(data, "--data.format=chat", batch=4)
    whole = build_data_source(cfg, dp_rank=0, dp_size=1)
    ranks = [build_data_source(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(5):  # crosses an epoch: about 8 rows
        both, a, b = next(whole), next(ranks[0]), next(ranks[1])
        assert torch.equal(torch.cat([a.input_ids, b.input_ids]), both.input_ids)
        assert torch.equal(torch.cat([a.labels, b.labels]), both.labels)
        assert all(torch.equal(x, y) for x, y in zip(a.cu_seqlens + b.cu_seqlens, both.cu_seqlens))
    state = ranks[1].state_dict()
    expected = [next(ranks[1]) for _ in range(3)]
    resumed = build_data_source(cfg, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    for batch in expected:
        got = next(resumed)
        assert torch.equal(got.input_ids, batch.input_ids) and torch.equal(got.labels, batch.labels)
    other_seed = build_data_source(config(data, "--data.format=chat", "--job.seed=1", batch=4), dp_rank=0, dp_size=1)
    assert not torch.equal(next(other_seed).input_ids, next(build_data_source(cfg, dp_rank=0, dp_size=1)).input_ids)


def test_a_record_longer_than_seq_len_is_refused_unless_truncate(tmp_path: Path) -> None:
    long = {"prompt": "short question", "completion": " the answer" * 20}
    prompt_only = {"prompt": "the fox jumps" * 20, "completion": " no"}
    data = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "completion": "b"}, long])
    with pytest.raises(ConfigError, match=r"^training.seq_len: .*c.jsonl:2: the record has \d+ tokens, more than "
                                          r"training.seq_len = 32; .*data.truncate = true"):
        build_token_stores(config(data, "--data.format=completion", seq_len=32))
    cfg = config(data, "--data.format=completion", "--data.truncate=true", seq_len=32)
    docs = list(iter_documents(cfg, config_tokenizer(cfg)))
    assert [len(d.ids) for d in docs][1] == 32 and all(docs[1].trained[-10:])  # its first 32 tokens, no EOS
    write_jsonl(data, [long, prompt_only])
    docs = list(iter_documents(cfg, config_tokenizer(cfg)))
    assert len(docs) == 1  # the prompt filled the row: nothing left to train on, so the record is dropped
    write_jsonl(data, [prompt_only])
    with pytest.raises(ConfigError, match=r"^data.path: no record in .*c.jsonl has a token to train on"):
        build_data_source(cfg, dp_rank=0, dp_size=1)


def test_a_large_corpus_is_sampled_before_launch_and_checked_whole_in_the_ranks(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Above FULL_SCAN_BYTES only the first SAMPLE_RECORDS of each file are read before launch; a bad record past
    them is found when a rank loads the corpus, with the message a full scan would give."""
    records = text_records(6)
    records[4] = {"body": "no text"}
    data = write_jsonl(tmp_path / "d.jsonl", records)
    cfg = config(data, seq_len=8)
    with pytest.raises(ConfigError) as full:
        build_token_stores(cfg)
    monkeypatch.setattr(corpus, "FULL_SCAN_BYTES", 0)
    monkeypatch.setattr(corpus, "SAMPLE_RECORDS", 2)
    build_token_stores(cfg)  # the sample (records 1-2) is fine
    with pytest.raises(ConfigError) as in_rank:
        build_data_source(cfg, dp_rank=0, dp_size=1)
    assert str(in_rank.value) == str(full.value) and str(full.value).startswith("data.text_key: ")
    assert f"{data}:5" in str(full.value)
    # A short corpus is still caught: the text is read on until one window is there.
    write_jsonl(data, [{"text": "a"}] * 5)
    with pytest.raises(ConfigError, match=r"^training.seq_len: the corpus at .* has \d+ tokens, fewer than one window"):
        build_token_stores(config(data, seq_len=64))
    build_token_stores(config(data, seq_len=8))  # 5 documents of 3 tokens: more than the 2-record sample holds
