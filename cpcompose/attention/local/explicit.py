"""The explicit attention kernel: softmax written out, tiled over query rows, with logit softcapping.

No fused CPU kernel (and none of the aten CUDA kernels) can cap logits, and some
devices have no fused kernel at all, so this one path serves both: the `math`
backend, and every block whose attention uses `softcap` (as in Gemma 2 and
flash-attn: `scores = softcap * tanh(q.k * scale / softcap)` before the softmax).

It follows the kernel conventions of `kernels.py` (GQA heads, float32 LSE, the
backward from the merged `out`/`lse`) and computes in float32 (float64 for float64
inputs). Scores are materialised one tile of query rows at a time, sized so a
tile holds at most `TILE_ELEMENTS` scores: memory stays bounded however long the
key block is, like the planner's band tiles.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpcompose.precision import accumulation_dtype

__all__ = ["TILE_ELEMENTS", "explicit_backward", "explicit_forward"]

TILE_ELEMENTS = 1 << 22  # scores per tile (16 MiB in float32); a few buffers this size are alive at once


def _row_tiles(q: Tensor, seq_k: int) -> list[slice]:
    """Query-row slices whose score tiles hold at most TILE_ELEMENTS each."""
    b, h, sq, _ = q.shape
    rows = max(1, TILE_ELEMENTS // max(1, b * h * seq_k))
    return [slice(r, min(r + rows, sq)) for r in range(0, sq, rows)]


def _scores(
    qg: Tensor, k: Tensor, rows: slice, *, causal: bool, scale: float, mask: Tensor | None, softcap: float | None
) -> tuple[Tensor, Tensor | None]:
    """Capped, masked scores `(B, Hkv, group, rows, Sk)` of one row tile, and the tanh (None without softcap)."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, rows], k) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if causal:  # top-left aligned: query row i sees keys j <= i
        i = torch.arange(rows.start, rows.stop, device=s.device)[:, None]
        s = s.masked_fill(i < torch.arange(k.shape[2], device=s.device)[None, :], float("-inf"))
    if mask is not None:
        s = s + mask[rows].to(s.dtype)
    return s, t


def _grouped(q: Tensor, n_kv: int, acc: torch.dtype) -> Tensor:
    b, hq, sq, d = q.shape
    return q.to(acc).reshape(b, n_kv, hq // n_kv, sq, d)


def explicit_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, mask: Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of `q` over `k`/`v`; returns `(out in q.dtype, lse in the compute dtype)`."""
    acc = accumulation_dtype(q.dtype)
    b, hq, sq, _ = q.shape
    hkv = k.shape[1]
    qg, kf, vf = _grouped(q, hkv, acc), k.to(acc), v.to(acc)
    out = torch.empty(b, hkv, hq // hkv, sq, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.empty(b, hkv, hq // hkv, sq, dtype=acc, device=q.device)
    for rows in _row_tiles(q, k.shape[2]):
        s, _ = _scores(qg, kf, rows, causal=causal, scale=scale, mask=mask, softcap=softcap)
        tile_lse = torch.logsumexp(s, dim=-1)
        out[:, :, :, rows] = torch.einsum("bhgqk,bhkd->bhgqd", torch.exp(s - tile_lse.unsqueeze(-1)), vf)
        lse[:, :, :, rows] = tile_lse
    return out.reshape(b, hq, sq, v.shape[-1]).to(q.dtype), lse.reshape(b, hq, sq)


def explicit_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
    mask: Tensor | None = None, softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`(dq, dk, dv)` of one block given the merged `out`/`lse`; dk/dv have K/V's head count.

    With softcap the chain rule passes through the tanh: d(softcap * tanh(x / softcap))/dx
    = 1 - tanh^2, applied to dS before it meets Q and K.
    """
    acc = accumulation_dtype(q.dtype)
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    qg, kf, vf = _grouped(q, hkv, acc), k.to(acc), v.to(acc)
    dog, og = _grouped(dout, hkv, acc), _grouped(out, hkv, acc)
    lse_g = lse.to(acc).reshape(b, hkv, hq // hkv, sq)
    dq = torch.empty_like(qg)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    for rows in _row_tiles(q, k.shape[2]):
        s, t = _scores(qg, kf, rows, causal=causal, scale=scale, mask=mask, softcap=softcap)
        p = torch.exp(s - lse_g[:, :, :, rows].unsqueeze(-1))
        do = dog[:, :, :, rows]
        delta = (do * og[:, :, :, rows]).sum(-1, keepdim=True)
        dv += torch.einsum("bhgqk,bhgqd->bhkd", p, do)
        ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", do, vf) - delta)
        if t is not None:
            ds = ds * (1 - t * t)
        dq[:, :, :, rows] = torch.einsum("bhgqk,bhkd->bhgqd", ds, kf) * scale
        dk += torch.einsum("bhgqk,bhgqd->bhkd", ds, qg[:, :, :, rows]) * scale
    return dq.reshape(b, hq, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
