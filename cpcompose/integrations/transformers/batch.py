"""A Hugging Face batch as one packed row for CP: padding dropped, documents kept, split balanced.

Under CP a rank holds a shard of the sequence, so neither the padding of a
right-padded batch nor the documents of a packed row (transformers' flattening
convention: `position_ids` restarting at 0) can be read from what one rank sees.
`pack_batch` reads them from the full batch, identical on every rank, and turns it
into one row of documents (every row's real tokens, cut where its positions
restart), padded at the end to what the `PackedLayout` needs with a document of its
own that carries no loss. Attention then never crosses a document, no document is
padded, and every real token's result is that of the original batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.agreement import Signature
from cpcompose.layouts import PackedLayout
from cpcompose.layouts.packed import Balance
from cpcompose.sharding.packed import pack_documents

__all__ = ["PackedBatch", "cu_seqlens_from_position_ids", "pack_batch", "shift_labels"]


@dataclass(frozen=True)
class PackedBatch:
    """Full-sequence tensors of one packed row, to shard with `layout` as context_parallel buffers."""

    input_ids: Tensor  # (1, L): every document, then the layout's padding
    position_ids: Tensor  # (1, L): restarting at 0 in every document (RoPE)
    labels: Tensor  # (1, L): each token's target, -100 where none (padding, ends of rows)
    layout: PackedLayout  # pass as context_parallel(..., layout=batch.layout)

    @property
    def buffers(self) -> list[Tensor]:
        """The tensors to give `context_parallel(buffers=...)` (sharded in place)."""
        return [self.input_ids, self.position_ids, self.labels]

    @property
    def seq_dims(self) -> list[int]:
        """Their sequence dims, for `buffer_seq_dims=`."""
        return [1, 1, 1]


def cu_seqlens_from_position_ids(position_ids: Tensor) -> list[int]:
    """Document boundaries of one row whose positions restart at every document.

    transformers' rule (`find_packed_sequence_indices`): a document starts wherever a
    position is not its predecessor + 1.
    """
    pos = position_ids.reshape(-1)
    starts = [0] + (torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1).tolist()
    return starts + [pos.numel()]


def shift_labels(labels: Tensor, *, ignore_index: int = -100) -> Tensor:
    """Targets for causal LM: token t predicts labels[t + 1]; the last of a row predicts nothing.

    Shift the full batch before sharding (transformers shifts inside its loss, which
    on a shard would pair tokens from different places).
    """
    shifted = torch.full_like(labels, ignore_index)
    shifted[..., :-1] = labels[..., 1:]
    return shifted


def pack_batch(
    input_ids: Tensor,
    mesh: DeviceMesh,
    *,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    labels: Tensor | None = None,
    shift: bool = True,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    balance: Balance = "documents",
    window: int | None = None,
) -> PackedBatch:
    """One packed row, split over the CP mesh, from a Hugging Face batch (the same on every rank).

    Args:
        input_ids: `(batch, seq)` token ids.
        mesh: the 1-D CP mesh.
        attention_mask: `(batch, seq)`, 1 for real tokens; right padding only.
        position_ids: `(batch, seq)` or `(1, seq)`; where they restart at 0 a new document
            begins (transformers' flattening collator). Default: one document per row.
        labels: `(batch, seq)`, -100 = no loss. Default: `input_ids`, -100 on padding.
        shift: causal LM targets (token t predicts labels[t+1] of its row, as
            transformers' loss shifts); False for masked LM (token t predicts labels[t]).
        pad_token_id: the id written into the layout's padding document.
        balance, window: how `PackedLayout.build` balances the split.

    Returns:
        A `PackedBatch`: give `buffers`/`seq_dims` and `layout` to `context_parallel`, feed
        `input_ids` and `position_ids` to the model, `labels` to `cp_cross_entropy`.

    Raises:
        ValueError: on every CP rank (one tiny all-gather) if any rank's batch is invalid
            (left padding, positions not restarting at 0, shapes) or the ranks' batches differ.
    """
    error = _batch_error(input_ids, attention_mask, position_ids, labels)
    packed = None
    if error is None:
        packed = _flatten(input_ids, attention_mask, position_ids, labels, shift, ignore_index)
        if packed[0].numel() == 0:
            error = "the batch has no real tokens (attention_mask is all zeros)"
    ids, positions, targets, cu = packed if packed is not None and error is None else ((), (), (), None)
    device = input_ids.device if isinstance(input_ids, Tensor) else torch.device("cpu")  # CUDA for NCCL
    batch = pack_documents(
        [t for t in (ids, positions, targets) if isinstance(t, Tensor)], cu, mesh,
        pad_values=[pad_token_id, None, ignore_index], what="pack_batch", error=error,
        signature=Signature().shape("input_ids", getattr(input_ids, "shape", ()), 2), balance=balance, window=window,
        device=device,
    )
    input_ids, position_ids, labels = batch.tensors
    return PackedBatch(input_ids=input_ids, position_ids=position_ids, labels=labels, layout=batch.layout)


def _batch_error(
    input_ids: object, attention_mask: object, position_ids: object, labels: object
) -> str | None:
    """What is wrong with this rank's batch, or None."""
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point():
        return f"input_ids must be a (batch, seq) integer tensor, got {getattr(input_ids, 'shape', type(input_ids))}"
    for name, t in (("attention_mask", attention_mask), ("labels", labels)):
        if t is not None and (not isinstance(t, Tensor) or t.shape != input_ids.shape):
            return f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {getattr(t, 'shape', t)!r}"
    if position_ids is not None and (
        not isinstance(position_ids, Tensor) or position_ids.ndim != 2
        or position_ids.shape[1] != input_ids.shape[1] or position_ids.shape[0] not in (1, input_ids.shape[0])
    ):
        return f"position_ids must be (batch or 1, {input_ids.shape[1]}), got {getattr(position_ids, 'shape', None)}"
    if isinstance(attention_mask, Tensor):
        mask = attention_mask.long()
        if not bool(((mask == 0) | (mask == 1)).all()):
            return "attention_mask must hold 0 (padding) and 1 (real token)"
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            return (
                "attention_mask has left (or inner) padding; pack_batch takes right-padded rows "
                "(padding_side='right'): real tokens first (or skip pack_batch: pass the padded batch with its "
                "attention_mask as a context_parallel buffer, whose padding then masks keys per row)"
            )
    if isinstance(position_ids, Tensor):
        pos = position_ids.expand(input_ids.shape[0], -1)
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        real = attention_mask.bool() if isinstance(attention_mask, Tensor) else torch.ones_like(starts)
        if bool((starts & real & (pos != 0)).any()):
            return (
                "position_ids must restart at 0 at every document (transformers' flattening convention); "
                "a run of consecutive positions starts elsewhere"
            )
    return None


def _flatten(
    input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None, labels: Tensor | None,
    shift: bool, ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """The rows' real tokens as one row: ids, positions, targets, and the documents' cu_seqlens."""
    rows, seq = input_ids.shape
    real = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    if labels is None:
        labels = input_ids.masked_fill(~real, ignore_index)
    targets = shift_labels(labels, ignore_index=ignore_index) if shift else labels
    if position_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device)[None]
    pos = position_ids.expand(rows, -1)
    lengths = real.sum(dim=1).tolist()
    cu = [0]
    for b, n in enumerate(lengths):
        if n:
            cu += [cu[-1] + end for end in cu_seqlens_from_position_ids(pos[b, :n])[1:]]
    keep = real.reshape(-1)
    return input_ids.reshape(-1)[keep], pos.reshape(-1)[keep], targets.reshape(-1)[keep], cu
