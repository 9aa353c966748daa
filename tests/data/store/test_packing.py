"""Best-fit-decreasing packing: no document shorter than a row is ever cut, every piece is placed once, rows are
no longer than their capacity and nearly full; and packed samples read back the documents' own tokens."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from cpcompose.data import IGNORE_INDEX, build_data_source
from cpcompose.data.store import TokenStore, best_fit_rows, pieces_of
from tests.support.token_stores import random_lengths, store_config, write_documents


@pytest.mark.parametrize("capacity", [16, 100])
def test_best_fit_cuts_only_documents_longer_than_a_row(capacity: int) -> None:
    lengths = np.array(random_lengths(400, 0, 3 * capacity, seed=capacity))
    pieces = pieces_of(lengths, capacity)
    packed, starts = best_fit_rows(pieces, capacity)
    assert Counter(map(tuple, packed.tolist())) == Counter(map(tuple, pieces.tolist()))  # each piece once
    for doc, n in enumerate(lengths.tolist()):
        mine = pieces[pieces[:, 0] == doc]
        if n <= capacity:  # whole: one piece from its start (none for an empty document)
            assert mine.tolist() == ([[doc, 0, n]] if n else [])
        else:  # cut at every row length, nowhere else
            assert mine[:, 1].tolist() == list(range(0, n, capacity)) and mine[:, 2].sum() == n
    used = np.add.reduceat(packed[:, 2], starts[:-1])
    assert used.max() <= capacity
    # Best fit fills rows: at most one more row than half-full rows would need over the tokens (a loose bound
    # that first-come packing of random lengths misses, and the exact bound, the total / capacity, is hard).
    assert starts.size - 1 <= int(np.ceil(lengths.sum() / capacity)) * 1.1 + 1


def test_best_fit_places_each_piece_in_the_tightest_row() -> None:
    # Longest first: 6, 6, 5 (row 2, 1 left), 4 (row 3, 2 left), 4 (row 4, 2 left), 3, 3 (row 5 full), 2 -> the
    # last opened of the rows with 2 left, 1 -> the row with exactly 1 left.
    pieces = pieces_of(np.array([5, 12, 3, 4, 4, 3, 2, 1]), 6)
    packed, starts = best_fit_rows(pieces, 6)
    rows = [sorted(packed[a:b, 2].tolist()) for a, b in zip(starts[:-1], starts[1:])]
    assert rows == [[6], [6], [1, 5], [4], [2, 4], [3, 3]]


def test_upsampling_repeats_long_documents_only() -> None:
    lengths = np.array([3, 10, 7, 20])
    pieces = pieces_of(lengths, 8, np.where(lengths >= 10, 3, 1))
    assert Counter(pieces[:, 0].tolist()) == {0: 1, 1: 3 * 2, 2: 1, 3: 3 * 3}


def test_packed_samples_hold_whole_documents_with_labels_inside_each(tmp_path: Path) -> None:
    lengths = random_lengths(120, 1, 70, seed=1)  # documents are [BOS] text EOS: 2 more ids
    data = write_documents(tmp_path / "docs.jsonl", lengths)
    cfg = store_config(data, tmp_path / "stores", "--data.pack=true", seq_len=48)
    source = build_data_source(cfg, dp_rank=0, dp_size=1).source
    store: TokenStore = source.stores[0]
    docs = {tuple(store.tokens[a:b].tolist()) for a, b in zip(store.offsets[:-1], store.offsets[1:])}
    whole = Counter()
    for i in range(source.epoch_length):
        sample = source.sample(i)
        cu, ids, labels = sample.cu_seqlens.tolist(), sample.input_ids.tolist(), sample.labels.tolist()
        assert cu[0] == 0 and cu[-1] == 48 and all(a < b for a, b in zip(cu, cu[1:]))
        for a, b in zip(cu, cu[1:]):
            piece = tuple(ids[a:b])
            if b == 48 and a == cu[-2] and piece not in docs and not any(_contains(d, piece) for d in docs):
                assert set(piece) == {store.pad_id} and set(labels[a:b]) == {IGNORE_INDEX}  # the row's padding
                continue
            if piece in docs:
                whole[piece] += 1
            else:  # a cut piece of a document longer than a row
                assert any(len(d) > 48 and _contains(d, piece) for d in docs)
            assert labels[a : b - 1] == list(piece[1:]) and labels[b - 1] == IGNORE_INDEX
    assert all(whole[d] == 1 for d in docs if len(d) <= 48)  # every document that fits: whole, once per epoch


def _contains(doc: tuple, piece: tuple) -> bool:
    return any(doc[i : i + len(piece)] == piece for i in range(0, len(doc), 48))
