"""What a sparse-attention indexer sees under CP: every key of the global row, in global order.

An indexer (DeepSeek sparse attention's, GLM-5's, ...) scores each query against every
earlier key and keeps the top-k. Under CP a rank holds only its queries' shard, so it
needs the indexer keys of the whole sequence (a few small heads: cheap to gather) and
the mask of the global row (causality by global position, documents of a pack). Given
both, the rank computes each of its queries' score row exactly as one process does,
entry for entry, and `torch.topk` on that row makes the same choice, equal scores
included: its selection is a function of the row's values and their order alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpcompose.comm import CommMeter, CPGroup, all_gather
from cpcompose.layouts import Layout

__all__ = ["allowed_keys", "global_doc_ids", "global_rows"]


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
