"""A per-row key mask (padding) that travels with K/V: one extra score term per key.

A CP layout is one split for every row of the batch, but padding differs per row, so
the mask cannot be a function of position like the causal, window and document masks
(`local.blocks`). Instead each key carries its own additive bias in K: q and k get
`EXTRA` more columns, `[1, 0, ...]` on every query and `[bias, 0, ...]` on every key, so
the kernel's `scale * (q . k)` becomes `scale * (q . k + bias)` with no change to any
strategy, kernel or plan. The bias column moves with K wherever a strategy sends it
(ring, all-gather, all-to-all, 2-D), in the strategy's own order, so nothing new
travels and no collective is added: the cost is `EXTRA / head_dim` more K (and Q, for
the head-sharded strategies) bytes and flops, only on calls that pass a key mask.

Real keys get bias 0 (exact: adding 0 changes no score). Padding keys get `PAD_BIAS`,
a finite number so large that the score is the bias alone after rounding, and every
`exp(score - lse)` of a row that sees a real key is exactly 0: the padding keys get no
weight and no gradient. Finite, not -inf: a block whose keys a row sees are all padding
then gives a finite partial result whose LSE is about `scale * PAD_BIAS`, which the
merge weighs by exactly 0 (an -inf there would give the CPU kernel's NaN). A query that
sees no real key at all (a row of padding only, a left-padded causal start, a padding
query whose window holds padding only) ends with such an LSE; its output is set to 0
and its LSE to -inf, as torch's SDPA gives for a fully masked row, and no gradient
flows through it.

Needs a dtype whose range holds `PAD_BIAS` (float32, bfloat16, float64; float16 is
refused) and no softcap (`softcap * tanh(.)` would squash the bias to `-softcap`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["EXTRA", "PAD_BIAS", "key_padding_error", "unseen_to_zero", "with_key_bias"]

EXTRA = 8
"""Columns added to q and k: a multiple of 8 keeps a head_dim that fused kernels accept."""

PAD_BIAS = -(2.0 ** 100)
"""The padding keys' score term before scaling: exactly representable in float32, bfloat16 and float64.

After `scale` (any value in [2**-80, 2**27]) it is below -2**20, so `exp` of it minus a real
row's LSE underflows to exactly 0, and it stays finite in float32."""

_UNSEEN = PAD_BIAS / 2
"""A scaled LSE below `scale * _UNSEEN` means the query saw padding keys only."""


def key_padding_error(key_padding: object, q: object, k: object, softcap: float | None) -> str | None:
    """Why `key_padding` is not a `(batch, seq_local)` bool mask of k's rows this call can honour, or None."""
    if key_padding is None or not isinstance(q, Tensor) or not isinstance(k, Tensor) or k.ndim != 4:
        return None
    want = (k.shape[0], k.shape[2])
    if not isinstance(key_padding, Tensor) or key_padding.dtype != torch.bool or tuple(key_padding.shape) != want:
        got = f"{key_padding.dtype} {tuple(key_padding.shape)}" if isinstance(key_padding, Tensor) else \
            type(key_padding).__name__
        return (f"key_padding must be a bool tensor (batch, seq_local) = {want} (True = a real key): this rank's "
                f"shard of the mask, cut like k (e.g. a context_parallel buffer), got {got}")
    if key_padding.device != k.device:
        return f"key_padding must be on k's device ({k.device}), got {key_padding.device}"
    if q.dtype == torch.float16:
        return ("key_padding with float16 q/k is not supported (float16 cannot hold the padding keys' bias): "
                "use bfloat16 or float32")
    if q.device.type == "cuda" and q.shape[-1] + EXTRA > 256:
        return (f"key_padding with head_dim {q.shape[-1]} on CUDA is not supported: the key bias widens it past the "
                "256 that flash kernels take")
    if softcap is not None:
        return (f"key_padding with softcap={softcap} is not supported (the cap would squash the padding keys' "
                "bias): pack the rows as documents instead (a PackedLayout, e.g. transformers' pack_batch)")
    return None


def with_key_bias(q: Tensor, k: Tensor, key_padding: Tensor) -> tuple[Tensor, Tensor]:
    """q and k with `EXTRA` more columns: `[1, 0, ...]` per query, `[0 or PAD_BIAS, 0, ...]` per key.

    Differentiable in q and k (their gradients are the first head_dim columns); the
    strategy must be given the original scale (the default would follow the new width).
    """
    b, h, s, _ = q.shape
    q_extra = q.new_zeros(b, h, s, EXTRA)
    q_extra[..., 0] = 1
    bias = torch.zeros(k.shape[0], k.shape[2], dtype=k.dtype, device=k.device).masked_fill(~key_padding, PAD_BIAS)
    k_extra = k.new_zeros(*k.shape[:3], EXTRA)
    k_extra[..., 0] = bias[:, None, :]
    return torch.cat([q, q_extra], dim=-1), torch.cat([k, k_extra], dim=-1)


def unseen_to_zero(out: Tensor, lse: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Queries that saw padding keys only: output 0 and LSE -inf (torch SDPA's fully masked row).

    `lse` is `(batch, heads, seq_local)` and `out` `(batch, heads, seq_local, head_dim_v)`.
    The zeroing is a `where`, so no gradient reaches those queries' scores.
    """
    unseen = lse < scale * _UNSEEN  # no host sync: the fill costs less than asking whether it is needed
    return out.masked_fill(unseen[..., None], 0), lse.masked_fill(unseen, float("-inf"))
