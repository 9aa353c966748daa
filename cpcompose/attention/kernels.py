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
the CPU kernel takes it directly, CUDA blocks with a mask use the explicit path.
V may have its own head dim (MLA); the fused kernels get zero-padded inputs.
`softcap` blocks run flash-attn's fused softcap on CUDA and the explicit path
(`explicit.py`) everywhere else.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from cpcompose import _compat
from cpcompose.attention.explicit import explicit_backward, explicit_forward

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
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, backend: Backend, mask: Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of `q` over `k`/`v`; returns `(out in q.dtype, lse float32)`.

    `v` may have another head dim than `q`/`k` (MLA); `out` has V's. `softcap`
    caps the logits (`softcap * tanh(scores / softcap)`): only flash-attn has it
    fused, every other backend then takes the explicit path.
    """
    if _explicit(backend, mask, softcap):
        return explicit_forward(q, k, v, causal=causal, scale=scale, mask=mask, softcap=softcap)
    dv = v.shape[-1]
    q, k, v = _same_head_dim(q, k, v)
    if backend == "cpu_flash":
        out, lse = _compat.cpu_flash_forward(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    elif backend == "flash_attn":
        out, lse = _flash_attn_forward(q, k, v, causal=causal, scale=scale, softcap=softcap)
    elif backend == "cuda_flash":
        ke, ve = _expand_kv(q, k), _expand_kv(q, v)
        out, lse = _compat.cuda_flash_forward(q, ke, ve, 0.0, causal, False, scale=scale)[:2]
    else:
        ke, ve = _expand_kv(q, k), _expand_kv(q, v)
        res = _compat.cuda_efficient_forward(q, ke, ve, None, True, 0.0, causal, scale=scale)
        out, lse = res[0], res[1][..., : q.shape[2]]
    return out[..., :dv], lse.contiguous()


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
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the merged `out`/`lse` of the full softmax.

    Returns `(dq, dk, dv)` in the input dtype; `dk`/`dv` have K/V's head count.
    """
    if _explicit(backend, mask, softcap):
        return explicit_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask, softcap=softcap)
    dqk, dv_dim = q.shape[-1], v.shape[-1]
    q, k, v = _same_head_dim(q, k, v)
    dout, out = _pad_last(dout, v.shape[-1]), _pad_last(out, v.shape[-1])
    if backend == "cpu_flash":
        dq, dk, dv = _compat.cpu_flash_backward(dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    elif backend == "flash_attn":
        dq, dk, dv = _flash_attn_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, softcap=softcap)
    else:
        dq, dk, dv = _cuda_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=backend)
    return dq[..., :dqk], dk[..., :dqk], dv[..., :dv_dim]


def _explicit(backend: Backend, mask: Tensor | None, softcap: float | None) -> bool:
    """Blocks the fused kernels cannot do: the math backend, softcap without flash-attn, masks on CUDA."""
    if backend == "math":
        return True
    if softcap is not None and backend != "flash_attn":
        return True
    return mask is not None and backend != "cpu_flash"


def _pad_last(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _same_head_dim(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-pad Q/K or V to one head dim for the fused kernels, which require it (MLA has Dv != Dqk).

    Exact: zero columns of Q and K add nothing to the scores (the scale is passed
    explicitly, so it is not recomputed from the padded width), and zero columns of V
    give zero output columns, which the caller slices off.
    """
    width = max(q.shape[-1], v.shape[-1])
    return _pad_last(q, width), _pad_last(k, width), _pad_last(v, width)


# --- CUDA helpers: thin, guarded, exercised by the same tests when a GPU is present ---


def _cuda_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
    backend: Backend,
) -> tuple[Tensor, Tensor, Tensor]:
    """The aten CUDA kernels' backward (no native GQA: K/V expanded, gradients summed back)."""
    ke, ve = _expand_kv(q, k), _expand_kv(q, v)
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    if backend == "cuda_flash":
        sq, sk = q.shape[2], k.shape[2]
        dq, dk, dv = _compat.cuda_flash_backward(
            dout, q, ke, ve, out, lse, None, None, sq, sk, 0.0, causal, zero, zero, scale=scale
        )
    else:
        dq, dk, dv, _ = _compat.cuda_efficient_backward(
            dout, q, ke, ve, None, out, _pad_lse_for_efficient(lse), zero, zero, 0.0, [True, True, True, False],
            causal, scale=scale,
        )
    return dq, _reduce_kv(dk, k), _reduce_kv(dv, v)


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


def _flash_attn_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, softcap: float | None
) -> tuple[Tensor, Tensor]:
    fa = _compat.import_flash_attn()
    assert fa is not None
    res = fa._flash_attn_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=softcap or 0.0,
        alibi_slopes=None, return_softmax=False,
    )
    return res[0].transpose(1, 2), res[1].contiguous()


def _flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
    softcap: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    fa = _compat.import_flash_attn()
    assert fa is not None
    t = [x.transpose(1, 2).contiguous() for x in (dout, q, k, v, out)]
    dq, dk, dv = (torch.empty_like(x) for x in t[1:4])
    fa._flash_attn_backward(
        t[0], t[1], t[2], t[3], t[4], lse, dq, dk, dv,
        dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=softcap or 0.0,
        alibi_slopes=None, deterministic=True, rng_state=None,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
