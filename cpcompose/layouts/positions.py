"""Whether a rank's position ids are its tokens' positions under a split (RoPE's input under CP).

One check for two callers: the Hugging Face attention runs it eagerly on every call, and the
`cpcompose::attention` custom op runs it inside itself when the attention is compiled (its
comparison reads tensor values, which dynamo cannot trace without a graph break).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpcompose.layouts.base import Layout
from cpcompose.layouts.packed import PackedLayout

__all__ = ["position_ids_error"]


def position_ids_error(position_ids: Tensor, layout: Layout, rank: int, local_len: int) -> str | None:
    """Why `position_ids` are not the positions of `rank`'s `local_len` tokens under `layout`, or None.

    Without them as a buffer, transformers numbers each shard from 0 and RoPE is silently wrong; with
    zigzag positions over a pack, attention would cross documents. The positions of a PackedLayout's
    padding document change no result and are not compared. A `local_len` the layout cannot hold is not
    judged here (the attention's own checks name it).
    """
    if layout.local_len_error(local_len):
        return None
    if position_ids.shape[-1] != local_len:
        return (
            f"position_ids cover {position_ids.shape[-1]} tokens but this rank holds {local_len}: pass the full "
            "position_ids as a context_parallel buffer"
        )
    expected = layout.position_ids(rank, local_len * layout.world, position_ids.device)
    checked = _non_padding(layout, rank, position_ids.device)
    if bool(((position_ids.reshape(-1, local_len) == expected) | ~checked).all()):
        return None
    return (
        f"position_ids are not the positions of this rank's tokens under the {layout.name} split "
        f"(expected {expected[:8].tolist()}..., got {position_ids.reshape(-1, local_len)[0, :8].tolist()}...): "
        "pass the full position_ids (torch.arange(seq_len); for packed documents, restarting at 0 per document "
        "with pack_batch's PackedLayout) as a context_parallel buffer"
    )


def _non_padding(layout: Layout, rank: int, device: torch.device) -> Tensor:
    """Which local tokens are not a PackedLayout's padding document (whose positions change no result)."""
    if not isinstance(layout, PackedLayout) or not layout.pad:
        return torch.ones((), dtype=torch.bool, device=device)
    return layout.local_indices(rank, device=device) < layout.seq_len - layout.pad
