"""A layer's own key mask (SDPA's `attn_mask`, MHA's `key_padding_mask`) as CP attention's `key_padding`.

Inside a CP region a layer sees this rank's tokens only, so a mask it builds from a
padding mask given to the region as a buffer indexes this rank's keys: exactly the
per-row key mask CP attention takes (`cp_attention(..., key_padding=)`, True = a real
key), which travels with K/V. Only a mask that depends on the key alone can be read
so; any mask with a query dimension indexes pairs no rank holds and stays refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["real_keys"]


def real_keys(mask: Tensor, batch: int, *, true_means_real: bool, what: str) -> tuple[Tensor | None, str | None]:
    """`mask` as a `(batch, keys)` bool mask of real keys, or why it cannot be.

    Args:
        mask: `(batch or 1, keys)`: bool, or float with 0 (a real key) and -inf (padding) only.
        batch: the batch size to expand a broadcast row to.
        true_means_real: a bool mask's convention: SDPA's True = take part (True), MHA's True = ignore (False).
        what: the mask's name, for messages.
    """
    if mask.ndim != 2 or mask.shape[0] not in (1, batch):
        return None, f"{what} of shape {tuple(mask.shape)} is not a per-key mask of (batch, keys)"
    if mask.dtype == torch.bool:
        real = mask if true_means_real else ~mask
    elif mask.is_floating_point() and bool(((mask == 0) | (mask == float("-inf"))).all()):
        real = mask == 0
    else:
        return None, f"{what} must be bool or hold 0 and -inf only (an arbitrary float bias per key is not supported)"
    return real.expand(batch, -1), None
