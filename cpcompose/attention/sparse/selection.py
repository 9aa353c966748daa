"""What a sparse-attention indexer sees under CP: every key of the global row, in global order.

An indexer (DeepSeek sparse attention's, GLM-5's, ...) scores each query against every
earlier key and keeps the top-k. Under CP a rank holds only its queries' shard, so it
needs the indexer keys of the whole sequence (a few small heads: cheap to gather) and
the mask of the global row (causality by global position, documents of a pack). Given
both, the rank computes each of its queries' score row exactly as one process does,
entry for entry.

The top-k itself is taken per document (`topk_per_document`): each query's choice among
its own document's keys only, on a row as long as that document, as the document run
alone takes it. Taking it over the whole row is not the same, even with every other
document's keys masked: many scores are exactly equal (an indexer's scores are sums of
ReLU'd products, so many are 0.0), and which of the tied keys `torch.topk` keeps depends
on the row's length and the tied entries' positions, not only on the values (measured:
DeepSeek-V3.2, a 128-token document alone keeps key 9 for query 26 where the same
document packed with an 88-token one keeps key 18). On the document's own row, `topk`
gets exactly the input it gets when the document runs alone and makes the same choice,
ties included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cpcompose.comm import CommMeter, CPGroup, all_gather
from cpcompose.layouts import Layout

__all__ = ["DocumentRows", "allowed_keys", "document_rows", "global_doc_ids", "global_rows", "topk_per_document"]


def global_rows(local: Tensor, layout: Layout, cp: CPGroup, *, dim: int = 1, meter: CommMeter | None = None) -> Tensor:
    """Every rank's shard of `local` (sequence along `dim`), joined in global order (no gradient flows)."""
    gathered = all_gather(local.detach().movedim(dim, 0).contiguous(), cp, meter)  # (P, S_local, ...)
    rank_major = gathered.reshape(-1, *gathered.shape[2:])
    return layout.to_global_order(rank_major, 0).movedim(0, dim)


def global_doc_ids(layout: Layout, seq_len: int, device: torch.device) -> Tensor:
    """The document of each global position (0 everywhere for an unpacked split)."""
    doc = torch.empty(seq_len, dtype=torch.long, device=device)
    for run in layout.global_runs(seq_len):
        doc[run.pos : run.pos + run.length] = run.doc
    return doc


def allowed_keys(layout: Layout, rank: int, seq_len: int, *, is_causal: bool, device: torch.device) -> Tensor:
    """`(S_local, seq_len)` bool: which global keys each of `rank`'s queries may read (causal, same document)."""
    positions = layout.local_indices(rank, seq_len, device)
    doc = global_doc_ids(layout, seq_len, device)
    allowed = doc[positions][:, None] == doc[None, :]
    if is_causal:
        allowed &= torch.arange(seq_len, device=device)[None, :] <= positions[:, None]
    return allowed


@dataclass(frozen=True)
class DocumentRows:
    """One document of a row: its keys' columns `[start, start + length)`, and the query rows in it, as
    `(first row, count)` runs of the scores' rows (a rank's local rows under CP)."""

    start: int
    length: int
    rows: tuple[tuple[int, int], ...]


def document_rows(layout: Layout, rank: int, seq_len: int) -> list[DocumentRows]:
    """The documents `rank`'s queries belong to, with their global key columns (python integers only: no
    tensor is read, so it also holds on fake tensors)."""
    local: dict[int, list[tuple[int, int]]] = {}
    for run in layout.runs(rank, seq_len):
        local.setdefault(run.doc, []).append((run.row, run.length))
    return [DocumentRows(run.pos, run.length, tuple(local[run.doc]))
            for run in layout.global_runs(seq_len) if run.doc in local]


def topk_per_document(scores: Tensor, k: int, documents: Sequence[Sequence[DocumentRows]], *, largest: bool = True,
                      sorted: bool = True) -> tuple[Tensor, Tensor]:
    """`torch.topk(scores, k)` with each query's choice made among its own document's columns only.

    Each query's top `min(k, document length)` is taken on the row of its document's columns, in order
    (the row the document run alone scores), and shifted to the columns' positions. A document shorter than
    `k` fills the rest of its queries' lists with a column outside it (repeated), which the attention may
    not read (another document's): the lists keep the shape attention expects.

    Args:
        scores: `(batch, rows, columns)`, masked as the caller masks them (later keys, other documents).
        k: the list length: at most `columns`.
        documents: per batch row (or one list for every row), the documents, covering every row once.
        largest, sorted: as `torch.topk`'s.

    Returns:
        `(values, indices)` of shape `(batch, rows, k)`; filled entries carry the value `topk` gives a
        masked key (-inf for `largest`).
    """
    batch, rows, columns = scores.shape
    values = scores.new_full((batch, rows, k), float("-inf") if largest else float("inf"))
    indices = torch.full((batch, rows, k), -1, dtype=torch.long, device=scores.device)  # -1: a row left uncovered
    for b in range(batch):
        for doc in documents[b if len(documents) > 1 else 0]:
            width = min(k, doc.length)
            outside = doc.start + doc.length if doc.start + doc.length < columns else doc.start - 1
            for first, count in doc.rows:
                # contiguous, as the document's own scores are: the same input to topk, on any device
                block = scores[b, first : first + count, doc.start : doc.start + doc.length].contiguous()
                picked = block.topk(width, dim=-1, largest=largest, sorted=sorted)
                values[b, first : first + count, :width] = picked.values
                indices[b, first : first + count, :width] = picked.indices + doc.start
                indices[b, first : first + count, width:] = outside
    return values, indices
