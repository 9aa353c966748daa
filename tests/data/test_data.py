"""cpcompose.data: synthetic recall, text files, tokenizers, packing, dp sharding and exact resume."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from cpcompose.config import ConfigError, load_config
from cpcompose.data import (
    IGNORE_INDEX,
    Batch,
    ByteTokenizer,
    HFTokenizer,
    SyntheticCopy,
    SyntheticRecall,
    TextSource,
    TokenBatcher,
    build_data_source,
    data_files,
    iter_records,
)

SYNTH = ["--data.task=recall", "--training.seq_len=256", "--training.batch_size=4", "--data.num_pairs=8", "--data.num_queries=4"]


def synthetic_loader(*argv: str, dp_rank: int = 0, dp_size: int = 1) -> TokenBatcher:
    return build_data_source(load_config([*SYNTH, *argv]), dp_rank=dp_rank, dp_size=dp_size)


def assert_same(a: Batch, b: Batch) -> None:
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert (a.cu_seqlens is None) == (b.cu_seqlens is None)
    for x, y in zip(a.cu_seqlens or [], b.cu_seqlens or []):
        assert torch.equal(x, y)


# ---- synthetic copy ---------------------------------------------------------------------------


def test_copy_task_second_half_repeats_the_first_and_only_it_is_supervised() -> None:
    task = SyntheticCopy(seq_len=64, seed=5, num_symbols=16)
    sample = task.sample(7)
    ids, labels = sample.input_ids, sample.labels
    assert ids[0] == task.bos_id and ids[32] == task.copy_id
    assert torch.equal(ids[1:32], ids[33:])
    assert (labels[:32] == IGNORE_INDEX).all() and labels[63] == IGNORE_INDEX
    assert torch.equal(labels[32:63], ids[33:])  # position t predicts the token copied from t - 31
    assert torch.equal(labels[32:63], ids[1:32])  # ... which sits 31 tokens back, in the first half
    assert not torch.equal(task.sample(8).input_ids, ids)
    assert torch.equal(task.sample(7).input_ids, ids)


def test_copy_is_the_default_synthetic_task() -> None:
    config = load_config(["--training.seq_len=128", "--training.batch_size=2"])
    batch = next(build_data_source(config, dp_rank=0, dp_size=1))
    assert torch.equal(batch.input_ids[:, 1:64], batch.input_ids[:, 65:])


# ---- synthetic recall ------------------------------------------------------------------------


def test_synthetic_batches_have_the_documented_shape_and_dtype() -> None:
    batch = next(synthetic_loader())
    assert batch.input_ids.shape == batch.labels.shape == (4, 256)
    assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
    assert batch.cu_seqlens is None
    assert int(batch.input_ids.max()) < SyntheticRecall(seq_len=256).vocab_size <= load_config(SYNTH).model.vocab_size


def test_synthetic_is_deterministic_per_seed_and_step_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first, second = synthetic_loader(), synthetic_loader()
    step0, step1 = next(first), next(first)
    assert torch.equal(torch.rand(3), expected_draw)  # the data drew nothing from the global RNG
    assert_same(step0, next(second))
    assert_same(step1, next(second))
    assert not torch.equal(step0.input_ids, step1.input_ids)
    assert not torch.equal(step0.input_ids, next(synthetic_loader("--job.seed=1")).input_ids)


@pytest.mark.parametrize("filler", ["random", "constant"])
def test_synthetic_answers_are_the_values_stored_under_early_keys(filler: str) -> None:
    task = SyntheticRecall(seq_len=512, seed=3, num_pairs=16, num_queries=6, filler=filler)  # type: ignore[arg-type]
    for index in range(8):
        sample = task.sample(index)
        ids, labels = sample.input_ids.tolist(), sample.labels.tolist()
        answered = [t for t, label in enumerate(labels) if label != IGNORE_INDEX]
        assert len(answered) == 6
        key_positions = [j for j in range(len(ids) - 2) if ids[j] == task.key_id]
        assert len(key_positions) == 16 and max(key_positions) + 2 < 256  # all pairs in the first half
        stored = {ids[j + 1]: ids[j + 2] for j in key_positions}
        assert len(stored) == 16  # keys are distinct, so each question has one answer
        for t in answered:
            assert t >= 512 - 3 * 6 and ids[t - 1] == task.query_id  # questions sit at the end
            assert labels[t] == stored[ids[t]] == ids[t + 1]


def test_dp_ranks_get_disjoint_shares_of_one_stream() -> None:
    rank0, rank1 = synthetic_loader(dp_rank=0, dp_size=2), synthetic_loader(dp_rank=1, dp_size=2)
    whole = synthetic_loader()  # dp_size 1 with the same global batch: twice the local batch
    assert rank0.batch_size == rank1.batch_size == 2 and whole.batch_size == 4
    for _ in range(2):
        a, b, both = next(rank0), next(rank1), next(whole)
        assert not torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(torch.cat([a.input_ids, b.input_ids]), both.input_ids)
        assert torch.equal(torch.cat([a.labels, b.labels]), both.labels)


def test_local_batch_divides_the_global_batch_by_dp_and_grad_accum() -> None:
    assert synthetic_loader("--training.batch_size=8", "--training.grad_accum_steps=2", dp_size=2).batch_size == 2
    with pytest.raises(ConfigError, match=r"^training.batch_size: 4 must be divisible by dp_size \* .* = 3"):
        synthetic_loader(dp_size=3)


def test_vocab_too_small_for_the_data_names_model_vocab_size() -> None:
    with pytest.raises(ConfigError, match=r"^model.vocab_size: 60 does not cover the 68 ids"):
        synthetic_loader("--model.vocab_size=60")


# ---- resume ----------------------------------------------------------------------------------


def test_state_dict_resume_gives_the_identical_next_batches() -> None:
    loader = synthetic_loader(dp_rank=1, dp_size=2)
    for _ in range(3):
        next(loader)
    state = loader.state_dict()
    expected = [next(loader) for _ in range(2)]
    resumed = synthetic_loader(dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    for batch in expected:
        assert_same(batch, next(resumed))
    # The position is global: the same run on a single dp rank resumes at the same samples.
    single = synthetic_loader()
    single.load_state_dict(state)
    assert torch.equal(next(single).input_ids[2:], expected[0].input_ids)


def test_load_state_dict_rejects_a_position_inside_a_micro_batch() -> None:
    loader = synthetic_loader(dp_size=2)
    with pytest.raises(ValueError, match="not a multiple of the global micro-batch 4"):
        loader.load_state_dict({"next_index": 6})


# ---- text ------------------------------------------------------------------------------------


def text_loader(path: Path, *argv: str, seq_len: int = 16, dp_rank: int = 0, dp_size: int = 1) -> TokenBatcher:
    config = load_config(["--data.source=text", "--data.store=false", f"--data.path={path}",  # the in-memory source
                          f"--training.seq_len={seq_len}", "--training.batch_size=2", "--lr_scheduler.warmup_steps=0",
                          *argv])
    return build_data_source(config, dp_rank=dp_rank, dp_size=dp_size)


def corpus(docs: list[str]) -> list[int]:
    tok = ByteTokenizer()
    return [i for doc in docs for i in [tok.bos_id, *tok.encode(doc), tok.eos_id]]


def test_byte_tokenizer_round_trips_any_text() -> None:
    tok = ByteTokenizer()
    text = "plain ascii, ümlaut, 漢字, emoji 🙂\n\ttabs"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)


def test_txt_file_gives_fixed_windows_with_shifted_labels(tmp_path: Path) -> None:
    text = " ".join(str(i) for i in range(100))  # no 16-token window repeats
    (tmp_path / "a.txt").write_text(text)
    tokens = corpus([text])
    loader = text_loader(tmp_path / "a.txt")
    assert isinstance(loader.source, TextSource) and loader.source.num_windows == (len(tokens) - 1) // 16
    windows = {tuple(tokens[s : s + 17]): s for s in range(0, len(tokens) - 16, 16)}
    seen = []
    for _ in range(loader.source.num_windows // 2):  # one epoch, two windows per batch
        batch = next(loader)
        assert batch.cu_seqlens is None and batch.input_ids.dtype == batch.labels.dtype == torch.int64
        for inputs, labels in zip(batch.input_ids.tolist(), batch.labels.tolist()):
            assert labels[:-1] == inputs[1:]  # labels[t] is the token at t + 1, no label masked
            seen.append(windows[tuple(inputs + labels[-1:])])  # a real window of seq_len + 1 tokens
    assert len(set(seen)) == len(seen)  # no window twice within an epoch


def test_one_epoch_is_a_permutation_of_all_windows(tmp_path: Path) -> None:
    text = " ".join(str(i) for i in range(100))
    (tmp_path / "a.txt").write_text(text)
    source = text_loader(tmp_path / "a.txt").source
    assert isinstance(source, TextSource)
    epoch0 = [tuple(source.sample(i).input_ids.tolist()) for i in range(source.num_windows)]
    epoch1 = [tuple(source.sample(source.num_windows + i).input_ids.tolist()) for i in range(source.num_windows)]
    tokens = corpus([text])
    windows = [tuple(tokens[w * 16 : w * 16 + 16]) for w in range(source.num_windows)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(windows)
    assert epoch0 != epoch1  # reshuffled each epoch


def test_jsonl_and_directories_are_read_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third"}) + "\n")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub" / "c.txt").write_text("fourth")
    (tmp_path / "notes.md").write_text("ignored")
    records = list(iter_records(data_files(tmp_path)))
    assert [r.value if isinstance(r.value, str) else r.value["text"] for r in records] == [
        "first", "second", "third", "fourth"]
    assert [r.where for r in records][1:3] == [f"{tmp_path / 'b.jsonl'}:1", f"{tmp_path / 'b.jsonl'}:3"]
    loader = text_loader(tmp_path / "b.jsonl", seq_len=4)
    assert isinstance(loader.source, TextSource)
    assert loader.source.tokens.tolist() == corpus(["second", "third"])


def test_bad_jsonl_line_names_file_line_and_key(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"^data.text_key: .*d.jsonl:2 has no 'text' field \(it has 'body'\)"):
        text_loader(tmp_path / "d.jsonl", seq_len=2)
    with pytest.raises(ConfigError, match="^data.path: .* does not exist"):
        text_loader(tmp_path / "missing", seq_len=2)


def test_corpus_shorter_than_a_window_names_seq_len(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("tiny")
    with pytest.raises(ConfigError, match=r"^training.seq_len: the corpus at .*a.txt has 6 tokens, fewer than one "
                                          r"window of training.seq_len \+ 1 = 65"):
        text_loader(tmp_path / "a.txt", seq_len=64)


def test_packing_returns_valid_cu_seqlens_and_masks_labels_across_documents(tmp_path: Path) -> None:
    docs = [json.dumps({"text": "doc number %d " % i + "x" * (i % 5)}) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("\n".join(docs))
    loader = text_loader(tmp_path / "d.jsonl", "--data.pack=true", seq_len=32)
    eos = ByteTokenizer.eos_id
    boundaries = 0
    for _ in range(6):
        batch = next(loader)
        assert batch.cu_seqlens is not None and len(batch.cu_seqlens) == 2
        for inputs, labels, cu in zip(batch.input_ids, batch.labels, batch.cu_seqlens):
            assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 32
            assert bool((cu[1:] > cu[:-1]).all())
            starts = [t for t in range(1, 32) if inputs[t - 1] == eos]
            assert cu[1:-1].tolist() == starts
            boundaries += len(starts)
            for t in range(32):
                if inputs[t] == eos:
                    assert labels[t] == IGNORE_INDEX  # would predict the next document
                elif t + 1 < 32:
                    assert labels[t] == inputs[t + 1]  # incl. the last token of a doc predicting EOS
    assert boundaries > 0


def test_packed_boundaries_come_from_where_documents_start_not_from_eos_ids() -> None:
    """A tokenizer may use its EOS id as BOS or inside text (GPT-2's <|endoftext|>): only the recorded starts count.

    Documents [9, 1, 9], [9, 2, 3, 9], [9, 4, 9] with 9 as both BOS and EOS: windows of 4 tokens (+1 label).
    """
    tokens = torch.tensor([9, 1, 9, 9, 2, 3, 9, 9, 4, 9])
    source = TextSource(tokens, torch.tensor([0, 3, 7]), seq_len=4, pack=True)
    by_start = {int(source._order(i)) * 4: source.sample(i) for i in range(source.num_windows)}
    first, second = by_start[0], by_start[4]
    assert first.input_ids.tolist() == [9, 1, 9, 9] and first.cu_seqlens.tolist() == [0, 3, 4]
    assert first.labels.tolist() == [1, 9, IGNORE_INDEX, 2]  # the last EOS predicts nothing in the next document
    assert second.input_ids.tolist() == [2, 3, 9, 9] and second.cu_seqlens.tolist() == [0, 3, 4]
    assert second.labels.tolist() == [3, 9, IGNORE_INDEX, 4]
    # A document starting right after the window: its first token is the last label, which must not be trained.
    edge = TextSource(torch.tensor([5, 6, 7, 9, 8, 8]), torch.tensor([0, 4]), seq_len=4, pack=True).sample(0)
    assert edge.cu_seqlens.tolist() == [0, 4] and edge.labels.tolist() == [6, 7, 9, IGNORE_INDEX]


def test_text_resume_across_an_epoch_boundary(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("abcdefghij" * 10)
    loader = text_loader(tmp_path / "a.txt")
    for _ in range(4):  # 3 batches of 2 = the 6 windows of epoch 0, then one into epoch 1
        next(loader)
    state = loader.state_dict()
    expected = [next(loader) for _ in range(3)]
    resumed = text_loader(tmp_path / "a.txt")
    resumed.load_state_dict(state)
    for batch in expected:
        assert_same(batch, next(resumed))


def test_hf_tokenizer_without_the_package_explains_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ConfigError, match="^data.tokenizer: .*pip install tokenizers"):
        HFTokenizer(str(tmp_path / "tokenizer.json"))
