"""Local attention kernels that return the log-sum-exp, behind one dispatch point.

Every CP strategy computes attention of a block of local queries against a block
of (possibly remote) keys/values, then merges the partial results through the
log-sum-exp (LSE). So each kernel here returns `(out, lse)` and its backward takes
the *merged* `out` and `lse`: with those, the gradient of one block is exact for
the full softmax, which is what lets the strategies split the work.

Conventions for all kernels: tensors are `(batch, heads, seq, head_dim)`; K/V may
have fewer heads than Q (GQA/MQA, `heads_q % heads_kv == 0`); `lse` is float32
(float64 for float64 inputs), contiguous, `(batch, heads_q, seq_q)`, natural log.
`causal=True` is only ever asked for square blocks (the block planner guarantees
it), so top-left versus bottom-right alignment never matters. `mask` is an
additive float mask `(seq_q, seq_k)` for the few window-edge blocks that need one;
the CPU kernel takes it directly, CUDA blocks with a mask use the math path.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from cpcompose import _compat
from cpcompose.precision import accumulation_dtype

Backend = Literal["cpu_flash", "math", "cuda_flash", "cuda_efficient", "flash_attn"]
BACKENDS: tuple[str, ...] = ("cpu_flash", "math", "cuda_flash", "cuda_efficient", "flash_attn")


def select_backend(q: Tensor, override: str | None = None) -> Backend:
    """Pick the kernel for `q`'s device and dtype: the one dispatch point.

    Args:
        q: the query tensor (its device and dtype decide).
        override: force a backend (tests use it to check the math path); None = best.

    Raises:
        ValueError: unknown override, or one that cannot run on this device.
    """
    if override is not None:
        if override not in BACKENDS:
            raise ValueError(f"backend={override!r} is unknown; choose one of {BACKENDS}")
        if override.startswith("cuda") or override == "flash_attn":
            if q.device.type != "cuda":
                raise ValueError(f"backend={override!r} needs CUDA tensors, got {q.device}")
        if override == "cpu_flash" and q.device.type != "cpu":
            raise ValueError(f"backend='cpu_flash' needs CPU tensors, got {q.device}")
        return override  # type: ignore[return-value]
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type == "cuda":
        half = q.dtype in (torch.float16, torch.bfloat16)
        if half and _compat.import_flash_attn() is not None:
            return "flash_attn"
        return "cuda_flash" if half else "cuda_efficient"
    return "math"


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, backend: Backend, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Attention of `q` over `k`/`v`; returns `(out in q.dtype, lse float32)`."""
    if backend == "cpu_flash":
        out, lse = _compat.cpu_flash_forward(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse.contiguous()
    if backend == "math" or mask is not None:
        return _math_forward(q, k, v, causal=causal, scale=scale, mask=mask)
    if backend == "flash_attn":
        return _flash_attn_forward(q, k, v, causal=causal, scale=scale)
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    if backend == "cuda_flash":
        res = _compat.cuda_flash_forward(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1].contiguous()
    res = _compat.cuda_efficient_forward(q, k, v, None, True, 0.0, causal, scale=scale)
    return res[0], res[1][..., : q.shape[2]].contiguous()


def attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    backend: Backend,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the merged `out`/`lse` of the full softmax.

    Returns `(dq, dk, dv)` in the input dtype; `dk`/`dv` have K/V's head count.
    """
    if backend == "cpu_flash":
        return _compat.cpu_flash_backward(dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    if backend == "math" or mask is not None:
        return _math_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask)
    if backend == "flash_attn":
        return _flash_attn_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    ke, ve = _expand_kv(q, k), _expand_kv(q, v)
    if backend == "cuda_flash":
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        sq, sk = q.shape[2], k.shape[2]
        dq, dk, dv = _compat.cuda_flash_backward(
            dout, q, ke, ve, out, lse, None, None, sq, sk, 0.0, causal, zero, zero, scale=scale
        )
    else:
        padded = _pad_lse_for_efficient(lse)
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = _compat.cuda_efficient_backward(
            dout, q, ke, ve, None, out, padded, zero, zero, 0.0, [True, True, True, False],
            causal, scale=scale,
        )
    return dq, _reduce_kv(dk, k), _reduce_kv(dv, v)


# --- math path: explicit softmax, for devices without a fused kernel and for tests ---


def _scores(q: Tensor, k: Tensor, *, causal: bool, scale: float, mask: Tensor | None) -> Tensor:
    """Scaled, masked scores `(B, Hkv, group, Sq, Sk)` in at least float32."""
    acc = accumulation_dtype(q.dtype)
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    qg = q.to(acc).view(b, hkv, hq // hkv, sq, d)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(acc)) * scale
    if causal:
        causal_mask = torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~causal_mask, float("-inf"))
    return s if mask is None else s + mask.to(s.dtype)


def _math_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    s = _scores(q, k, causal=causal, scale=scale, mask=mask)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhgqk,bhkd->bhgqd", torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype))
    b, hq, sq, _ = q.shape
    return out.reshape(b, hq, sq, v.shape[-1]).to(q.dtype), lse.reshape(b, hq, sq)


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    s = _scores(q, k, causal=causal, scale=scale, mask=mask)
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    acc = s.dtype
    grp = (b, hkv, hq // hkv, sq)
    p = torch.exp(s - lse.to(acc).view(*grp, 1))
    do = dout.to(acc).view(*grp, -1)
    delta = (do * out.to(acc).view(*grp, -1)).sum(-1, keepdim=True)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", do, v.to(acc)) - delta)
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(acc)) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q.to(acc).view(*grp, d)) * scale
    return dq.reshape(b, hq, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --- CUDA helpers: thin, guarded, exercised by the same tests when a GPU is present ---


def _expand_kv(q: Tensor, kv: Tensor) -> Tensor:
    """Repeat K/V heads locally for kernels without native GQA (after any communication)."""
    group = q.shape[1] // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _reduce_kv(dkv: Tensor, kv: Tensor) -> Tensor:
    """Sum the gradients of repeated K/V heads back onto the real heads."""
    b, h, s, d = dkv.shape
    group = h // kv.shape[1]
    return dkv if group == 1 else dkv.view(b, kv.shape[1], group, s, d).sum(2)


def _pad_lse_for_efficient(lse: Tensor) -> Tensor:
    """The efficient kernel stores the LSE padded to a multiple of 32 queries."""
    pad = (-lse.shape[-1]) % 32
    return torch.nn.functional.pad(lse, (0, pad)) if pad else lse


def _flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    fa = _compat.import_flash_attn()
    assert fa is not None
    res = fa._flash_attn_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0,
        alibi_slopes=None, return_softmax=False,
    )
    return res[0].transpose(1, 2), res[1].contiguous()


def _flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    fa = _compat.import_flash_attn()
    assert fa is not None
    t = [x.transpose(1, 2).contiguous() for x in (dout, q, k, v, out)]
    dq, dk, dv = (torch.empty_like(x) for x in t[1:4])
    fa._flash_attn_backward(
        t[0], t[1], t[2], t[3], t[4], lse, dq, dk, dv,
        dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0,
        alibi_slopes=None, deterministic=True, rng_state=None,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
