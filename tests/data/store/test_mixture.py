"""Mixtures of token stores: the weights hold over every epoch (and any stretch of one), the stream is a pure
function of the seed, and resuming mid-epoch is exact with another dp size."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cpcompose.config import ConfigError, load_config
from cpcompose.data import TokenBatcher, build_data_source
from cpcompose.data.store import apportion, schedule
from tests.support.token_stores import random_lengths, write_documents


def mixture_config(tmp_path: Path, weights: list[float], *argv: str, batch: int = 4):
    tables = []
    for n, w in enumerate(weights):  # sources of different sizes, so weights and sizes disagree
        data = write_documents(tmp_path / f"src{n}" / "docs.jsonl", random_lengths(20 + 15 * n, 1, 90, seed=n), seed=n)
        tables.append(f'{{"path": "{data.parent}", "weight": {w}}}')
    return load_config(["--data.source=text", f"--data.store_dir={tmp_path / 'stores'}", "--training.seq_len=32",
                        f"--training.batch_size={batch}", f"--data.sources=[{', '.join(tables)}]", *argv])


@pytest.mark.parametrize("pack", ["true", "false"])
def test_each_source_gets_its_weight_over_an_epoch_within_one_sample(tmp_path: Path, pack: str) -> None:
    weights = [0.5, 0.3, 0.2]
    source = build_data_source(mixture_config(tmp_path, weights, f"--data.pack={pack}"), dp_rank=0, dp_size=1).source
    n = source.epoch_length
    counts = Counter(source.source_of(i) for i in range(n))
    for s, w in enumerate(weights):
        assert abs(counts[s] - w * n) <= 1 and abs(counts[s] / n - w) < 0.01  # largest remainder: one sample
    for lo in (0, n // 3):  # spread through the epoch: any stretch of it is close to the weights too
        stretch = Counter(source.source_of(i) for i in range(lo, lo + n // 2))
        assert all(abs(stretch[s] - w * (n // 2)) <= 2 for s, w in enumerate(weights))
    summary = source.summary(num_samples=3 * n)
    assert [round(row["share"], 2) for row in summary] == weights
    assert all(row["epochs"] == pytest.approx(3 * row["share"] * n / row["samples_per_epoch"]) for row in summary)
    lines = source.report(3 * n, tmp_path / "lengths.png")
    assert len(lines) == 4 and lines[0].startswith(f"data {tmp_path / 'src0'}: 20 documents, ")
    assert f"{100 * summary[0]['share']:.1f}% of the mixture" in lines[0]
    assert lines[-1] == f"data lengths: {tmp_path / 'lengths.png'}"
    with Image.open(tmp_path / "lengths.png") as png:
        assert png.format == "PNG" and png.size[0] == 800


def test_apportion_and_schedule_are_exact_and_interleaved() -> None:
    counts = apportion([2.0, 1.0, 1.0], 10)
    assert counts.tolist() == [5, 3, 2] and counts.sum() == 10  # 5, 2.5, 2.5: the tie goes to the first
    which, nth = schedule(counts)
    for s in range(3):
        assert nth[which == s].tolist() == list(range(counts[s]))  # each source's samples in order, each once
    for p in range(1, 11):  # every prefix holds each source's share of it to within one sample
        prefix = Counter(which[:p].tolist())
        assert all(abs(prefix[s] - p * counts[s] / 10) <= 1 for s in range(3))


def _next_batches(loader: TokenBatcher, steps: int) -> list[torch.Tensor]:
    return [next(loader).input_ids for _ in range(steps)]


def test_resume_mid_epoch_is_exact_with_another_dp_size(tmp_path: Path) -> None:
    cfg = mixture_config(tmp_path, [0.6, 0.4], "--data.pack=true", batch=4)
    one = build_data_source(cfg, dp_rank=0, dp_size=1)
    _next_batches(one, 3)
    state = one.state_dict()
    expected = _next_batches(one, 2 + one.source.epoch_length // 4)  # runs on across the epoch boundary
    halves = [build_data_source(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    for loader in halves:
        loader.load_state_dict(state)
    got = [torch.cat(pair) for pair in zip(*(_next_batches(loader, len(expected)) for loader in halves))]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    again = build_data_source(cfg, dp_rank=0, dp_size=1)  # reopened: the same stream from the same seed
    assert all(torch.equal(a, b) for a, b in zip(_next_batches(again, 5)[3:], expected[:2]))


def test_the_seed_changes_the_stream_and_sources_are_shuffled_apart(tmp_path: Path) -> None:
    base = mixture_config(tmp_path, [1, 1], "--data.pack=true")
    other = mixture_config(tmp_path, [1, 1], "--data.pack=true", "--job.seed=1")
    a, b = (build_data_source(c, dp_rank=0, dp_size=1).source for c in (base, other))
    assert not all(torch.equal(a.sample(i).input_ids, b.sample(i).input_ids) for i in range(8))


def test_windows_through_a_store_equal_the_in_memory_corpus(tmp_path: Path) -> None:
    """The default (a store in the per-user cache) and data.store = false read the same windows."""
    data = write_documents(tmp_path / "docs.jsonl", random_lengths(50, 1, 120, seed=3))
    argv = ["--data.source=text", f"--data.path={data}", "--training.seq_len=32", "--training.batch_size=2"]
    memory = build_data_source(load_config([*argv, "--data.store=false"]), dp_rank=0, dp_size=1)
    stored = build_data_source(load_config(argv), dp_rank=0, dp_size=1)
    for _ in range(memory.source.num_windows):  # a whole epoch and then some
        x, y = next(memory), next(stored)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)


def test_upsampling_needs_packed_rows(tmp_path: Path) -> None:
    data = write_documents(tmp_path / "d" / "docs.jsonl", [40, 50])
    cfg = load_config(["--data.source=text", f"--data.store_dir={tmp_path / 's'}", "--training.seq_len=32",
                       f'--data.sources=[{{"path": "{data}", "long_doc_tokens": 45, "long_doc_repeat": 2}}]'])
    with pytest.raises(ConfigError, match=r"^data.sources\[0\].long_doc_tokens: .*data.pack = true"):
        build_data_source(cfg, dp_rank=0, dp_size=1)
    assert np.array_equal(apportion([1.0], 7), [7])
