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
it), so top-left versus bottom-right alignment never matters. `band` describes
the few window-edge blocks that are neither full nor causal (`Band`: which key each
query row sees); each backend takes it in its own form: flash-attn as its native
`window_size` (shifted to its bottom-right alignment), the CUDA efficient kernel and
the CPU kernel as an additive bias, the explicit path as a mask. No window-edge
block falls back to the explicit softmax on CUDA any more.
V may have its own head dim (MLA); the fused kernels get zero-padded inputs.
`softcap` blocks run flash-attn's fused softcap on CUDA and the explicit path
(`explicit.py`) everywhere else. Which kernel runs: `select_backend`, the one
dispatch point (bf16/fp16 to flash-attn when installed, else "cuda_fused":
PyTorch's cuDNN or flash kernel per block, by the rule `cudnn_is_faster` measured
with `scripts/benchmarks/bench_cuda_kernels.py`; fp32 to the memory-efficient kernel; float64
to the explicit path, which the fused CUDA kernels do not support).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from cpcompose import _compat
from cpcompose.attention.local.explicit import explicit_backward, explicit_forward

__all__ = [
    "BACKENDS", "CUDNN_MIN_WORK", "EFFICIENT_BIAS_ALIGN", "UNBOUNDED", "Backend", "Band", "KernelArgs",
    "attention_backward", "attention_forward", "cudnn_is_faster", "select_backend", "supports_varlen",
    "varlen_backward", "varlen_forward",
]

Backend = Literal["cpu_flash", "math", "cuda_fused", "cuda_flash", "cuda_efficient", "cuda_cudnn", "flash_attn"]
BACKENDS: tuple[str, ...] = (
    "cpu_flash", "math", "cuda_fused", "cuda_flash", "cuda_efficient", "cuda_cudnn", "flash_attn"
)
UNBOUNDED = 1 << 62  # a window side with no limit (the block planner's NO_WINDOW)
# Blocks of at least this much work (heads x visible query-key pairs x head dim) run faster on
# cuDNN than on PyTorch's flash kernel on an H100 (torch 2.11, cuDNN 9.19, bf16, forward +
# backward): 1.24-1.80x from 2^31 up; at 2^29 a tie (8 heads x 1024^2 x 64, full) and at 2^28
# flash 1.3x faster (the same block causal). README "CUDA kernels" table; Hopper only.
CUDNN_MIN_WORK = 1 << 30


class Band(NamedTuple):
    """Which keys each query row of a block sees: key b is visible to row a iff
    `-right <= offset + a - b <= left` (`offset`: row 0's position minus key 0's).

    flash-attn's `(left, right)` window sizes, with the block's own alignment; a
    side of `UNBOUNDED` has no limit.
    """

    offset: int
    left: int
    right: int

    def visible(self, n_q: int, n_k: int, device: torch.device | str | None = None) -> Tensor:
        """The boolean `(n_q, n_k)` mask."""
        d = (torch.arange(n_q, device=device)[:, None] + self.offset - torch.arange(n_k, device=device)[None, :])
        return (d >= -self.right) & (d <= self.left)

    def count(self, n_q: int, n_k: int) -> int:
        """`visible(n_q, n_k).sum()` in closed form (planners weigh many bands).

        Pairs on the diagonal d = key - row number `min(n_q, n_k - d) - max(0, -d)`
        for d in [1 - n_q, n_k - 1]; the band keeps d in [offset - left, offset + right].
        """
        lo, hi = max(self.offset - self.left, 1 - n_q), min(self.offset + self.right, n_k - 1)
        if lo > hi:
            return 0

        def total(first: int, last: int) -> int:  # first + ... + last (0 when empty)
            return (first + last) * (last - first + 1) // 2 if last >= first else 0

        bend = n_k - n_q  # min(n_q, n_k - d) is n_q up to here, n_k - d after
        capped = n_q * max(0, min(hi, bend) - lo + 1) + total(n_k - hi, n_k - max(lo, bend + 1))
        return capped - total(-min(hi, -1), -lo)  # minus max(0, -d) on the diagonals below the main one

    def additive(self, n_q: int, n_k: int, dtype: torch.dtype, device: torch.device, align: int = 1) -> Tensor:
        """The float mask (0 visible, -inf hidden); its rows are padded to a multiple of `align`
        elements in memory (the efficient kernel's bias alignment) and sliced back."""
        width = -(-n_k // align) * align
        mask = torch.zeros(n_q, width, dtype=dtype, device=device)[:, :n_k]
        return mask.masked_fill_(~self.visible(n_q, n_k, device), float("-inf"))

    def flash_window(self, n_q: int, n_k: int) -> tuple[int, int] | None:
        """flash-attn's `(window_size_left, window_size_right)` for this band, or None when it has none.

        flash-attn aligns query i with key `i + n_k - n_q` (bottom-right) and lets it
        see keys `[i + n_k - n_q - left, i + n_k - n_q + right]`; the band's own
        offset shifts both sides by `offset - (n_k - n_q)`. A side that becomes
        negative has no flash-attn spelling (-1 means unbounded there).
        """
        shift = self.offset - (n_k - n_q)
        left = -1 if self.left >= UNBOUNDED else self.left - shift
        right = -1 if self.right >= UNBOUNDED else self.right + shift
        if (self.left < UNBOUNDED and left < 0) or (self.right < UNBOUNDED and right < 0):
            return None
        return left, right


@dataclass(frozen=True)
class KernelArgs:
    """What every kernel call of one attention shares."""

    scale: float
    backend: Backend
    softcap: float | None = None  # logit cap (`softcap * tanh(s / softcap)`); None = no cap


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
        if override in ("cuda_fused", "cuda_flash", "cuda_cudnn", "flash_attn") and q.dtype not in (
            torch.float16, torch.bfloat16
        ):
            raise ValueError(f"backend={override!r} takes float16/bfloat16, got {q.dtype}")
        if override == "cuda_efficient" and q.dtype == torch.float64:
            raise ValueError("backend='cuda_efficient' does not take float64; use 'math'")
        if override == "cpu_flash" and q.device.type != "cpu":
            raise ValueError(f"backend='cpu_flash' needs CPU tensors, got {q.device}")
        return override  # type: ignore[return-value]
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type == "cuda":
        if q.dtype == torch.float64:
            return "math"  # no fused CUDA kernel takes float64
        half = q.dtype in (torch.float16, torch.bfloat16)
        if half and _compat.has_flash_attn():
            return "flash_attn"
        return "cuda_fused" if half else "cuda_efficient"
    return "math"


def cudnn_is_faster(heads: int, n_q: int, n_k: int, head_dim: int, causal: bool, capability: tuple[int, int]) -> bool:
    """Whether a bf16/fp16 block runs faster on cuDNN than on PyTorch's flash kernel (measured, see CUDNN_MIN_WORK).

    Only on Hopper or later (where it was measured; elsewhere flash, as before) and
    for head dims cuDNN's kernels take (a multiple of 8, at most 128).
    """
    if capability < (9, 0) or head_dim % 8 or head_dim > 128:
        return False
    return heads * n_q * n_k * head_dim // (2 if causal else 1) >= CUDNN_MIN_WORK


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, backend: Backend, band: Band | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of `q` over `k`/`v`; returns `(out in q.dtype, lse float32)`.

    `v` may have another head dim than `q`/`k` (MLA); `out` has V's. `band`: the
    block's window edges (see `Band`), None for a full or causal block. `softcap`
    caps the logits (`softcap * tanh(scores / softcap)`): only flash-attn has it
    fused, every other backend then takes the explicit path.
    """
    backend, window = _route(backend, band, softcap, q, k, causal)
    if _runs_in_float32(backend, band, q):
        out, lse = attention_forward(
            q.float(), k.float(), v.float(), causal=causal, scale=scale, backend=backend, band=band
        )
        return out.to(q.dtype), lse
    if backend == "math":
        return explicit_forward(q, k, v, causal=causal, scale=scale, mask=_mask(band, q, k), softcap=softcap)
    dv = v.shape[-1]
    q, k, v = _same_head_dim(q, k, v)
    if backend == "cpu_flash":
        out, lse = _compat.cpu_flash_forward(q, k, v, 0.0, causal, attn_mask=_mask(band, q, k), scale=scale)
    elif backend == "flash_attn":
        out, lse = _flash_attn_forward(q, k, v, causal=causal, scale=scale, softcap=softcap, window=window)
    elif backend == "cuda_flash":
        ke, ve = _expand_kv(q, k), _expand_kv(q, v)
        out, lse = _compat.cuda_flash_forward(q, ke, ve, 0.0, causal, False, scale=scale)[:2]
    elif backend == "cuda_cudnn":
        ke, ve = _expand_kv(q, k), _expand_kv(q, v)
        out, lse = _compat.cuda_cudnn_forward(q, ke, ve, None, True, 0.0, causal, False, scale=scale)[:2]
        lse = lse.reshape(q.shape[:3])  # cuDNN keeps a trailing unit dim
    else:
        ke, ve = _expand_kv(q, k), _expand_kv(q, v)
        res = _compat.cuda_efficient_forward(q, ke, ve, _bias(band, q, k), True, 0.0, causal, scale=scale)
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
    band: Band | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the merged `out`/`lse` of the full softmax.

    Returns `(dq, dk, dv)` in the input dtype; `dk`/`dv` have K/V's head count.
    """
    backend, window = _route(backend, band, softcap, q, k, causal)
    if _runs_in_float32(backend, band, q):
        grads = attention_backward(
            dout.float(), q.float(), k.float(), v.float(), out.float(), lse, causal=causal, scale=scale,
            backend=backend, band=band,
        )
        return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)
    if backend == "math":
        mask = _mask(band, q, k)
        return explicit_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask, softcap=softcap)
    dqk, dv_dim = q.shape[-1], v.shape[-1]
    q, k, v = _same_head_dim(q, k, v)
    dout, out = _pad_last(dout, v.shape[-1]), _pad_last(out, v.shape[-1])
    if backend == "cpu_flash":
        dq, dk, dv = _compat.cpu_flash_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=_mask(band, q, k), scale=scale
        )
    elif backend == "flash_attn":
        dq, dk, dv = _flash_attn_backward(
            dout, q, k, v, out, lse, causal=causal, scale=scale, softcap=softcap, window=window
        )
    else:
        dq, dk, dv = _cuda_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=backend, band=band)
    return dq[..., :dqk], dk[..., :dqk], dv[..., :dv_dim]


def _route(
    backend: Backend, band: Band | None, softcap: float | None, q: Tensor, k: Tensor, causal: bool
) -> tuple[Backend, tuple[int, int]]:
    """The backend that actually runs this block, and flash-attn's window for it.

    What the chosen backend cannot do moves the block, never the whole call: softcap
    without flash-attn goes to the explicit path; a band goes to flash-attn's
    native window when it has a spelling there, else (and for PyTorch's flash and
    cuDNN kernels, which take no mask) to the efficient kernel with an additive bias.
    "cuda_fused" picks cuDNN or flash for each plain block (`cudnn_is_faster`).
    """
    if backend == "math" or (softcap is not None and backend != "flash_attn"):
        return "math", (-1, -1)
    if band is None:
        if backend == "cuda_fused":
            faster = cudnn_is_faster(
                q.shape[1], q.shape[2], k.shape[2], q.shape[3], causal, _capability(q.get_device())
            )
            return ("cuda_cudnn" if faster else "cuda_flash"), (-1, -1)
        return backend, (-1, -1)
    if backend == "flash_attn":
        window = band.flash_window(q.shape[2], k.shape[2])
        if window is not None:
            return backend, window
        return ("math" if softcap is not None else "cuda_efficient"), (-1, -1)
    if backend in ("cuda_fused", "cuda_flash", "cuda_cudnn"):
        return "cuda_efficient", (-1, -1)
    return backend, (-1, -1)


def _runs_in_float32(backend: Backend, band: Band | None, q: Tensor) -> bool:
    """Whether a half-precision block must run its kernel in float32 (inputs converted, results converted back).

    Two kernels need it. On the H100 (torch 2.11) the efficient kernel's bf16 backward
    with an additive bias returned dq and dk off by O(1) to 1e37 on the window-edge
    blocks CP plans make (dv right, so its row statistics were wrong), while float32 was
    exact: found by the first GPU run, pinned to those blocks by comparing each block's
    gradients with float64; only those few blocks pay the conversion. And torch's CPU
    flash kernel cannot run bf16 at all under `ATEN_CPU_CAPABILITY=avx2` on AVX-512 BF16
    or AMX hardware (`_compat.cpu_flash_takes_bfloat16`). The tensors saved for the
    backward stay in the caller's dtype, so memory is as planned.
    """
    if backend == "cpu_flash":
        return q.dtype == torch.bfloat16 and not _compat.cpu_flash_takes_bfloat16()
    return backend == "cuda_efficient" and band is not None and q.dtype in (torch.float16, torch.bfloat16)


def _mask(band: Band | None, q: Tensor, k: Tensor) -> Tensor | None:
    """The additive `(Sq, Sk)` mask of a band for the CPU and explicit kernels."""
    return None if band is None else band.additive(q.shape[2], k.shape[2], q.dtype, q.device)


EFFICIENT_BIAS_ALIGN = 16  # the memory-efficient kernel wants its bias rows 16-element aligned


def _bias(band: Band | None, q: Tensor, k: Tensor) -> Tensor | None:
    """The efficient kernel's `(B, H, Sq, Sk)` additive bias for a band (a broadcast view, no copy)."""
    if band is None:
        return None
    mask = band.additive(q.shape[2], k.shape[2], q.dtype, q.device, align=EFFICIENT_BIAS_ALIGN)
    return mask.expand(q.shape[0], q.shape[1], *mask.shape)


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
    backend: Backend, band: Band | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The aten CUDA kernels' backward (no native GQA: K/V expanded, gradients summed back).

    `lse` is made contiguous: callers pass row slices of the merged LSE (a zigzag
    rank's late chunk, say), and the flash and cuDNN kernels read it as a dense
    (batch, heads, rows) array without looking at its strides (the first GPU run
    found dq wrong by O(1) on such slices with batch 2).
    """
    ke, ve = _expand_kv(q, k), _expand_kv(q, v)
    lse = lse.contiguous()
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    sq, sk = q.shape[2], k.shape[2]
    if backend == "cuda_flash":
        dq, dk, dv = _compat.cuda_flash_backward(
            dout, q, ke, ve, out, lse, None, None, sq, sk, 0.0, causal, zero, zero, scale=scale
        )
    elif backend == "cuda_cudnn":
        dq, dk, dv = _compat.cuda_cudnn_backward(  # no bias, not varlen: undefined tensors, as autograd passes
            dout, q, ke, ve, out, lse.unsqueeze(-1), zero, zero, None, None, None, sq, sk, 0.0, causal, scale=scale,
        )
    else:
        dq, dk, dv, _ = _compat.cuda_efficient_backward(
            dout, q, ke, ve, _bias(band, q, k), out, _pad_lse_for_efficient(lse), zero, zero, 0.0,
            [True, True, True, False], causal, scale=scale,
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
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, softcap: float | None,
    window: tuple[int, int] = (-1, -1),
) -> tuple[Tensor, Tensor]:
    res = _compat.flash_attn_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=window[0], window_size_right=window[1], softcap=softcap or 0.0,
        alibi_slopes=None, return_softmax=False,
    )
    return res[0].transpose(1, 2), res[1].contiguous()


def _flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
    softcap: float | None, window: tuple[int, int] = (-1, -1),
) -> tuple[Tensor, Tensor, Tensor]:
    t = [x.transpose(1, 2).contiguous() for x in (dout, q, k, v, out)]
    dq, dk, dv = (torch.empty_like(x) for x in t[1:4])
    _compat.flash_attn_backward(  # the LSE read as a dense array, like the aten kernels (see _cuda_backward)
        t[0], t[1], t[2], t[3], t[4], lse.contiguous(), dq, dk, dv,
        dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=window[0], window_size_right=window[1], softcap=softcap or 0.0,
        alibi_slopes=None, deterministic=True, rng_state=None,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# --- varlen: many blocks in one call (flash-attn), for packed documents ---


def supports_varlen(backend: Backend) -> bool:
    """Whether `backend` runs many independent blocks in one call (flash-attn's varlen functions)."""
    return backend == "flash_attn" and _compat.has_flash_attn_varlen()


def varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *, causal: bool,
    scale: float, softcap: float | None,
) -> tuple[Tensor, Tensor]:
    """Blocks packed end to end: `q (Tq, H, D)`, `k`/`v (Tk, Hkv, D)`, segment bounds `cu_q`/`cu_k` (int32).

    Returns `(out (Tq, H, Dv), lse (H, Tq) float32)`: segment i is block i's own
    attention, as if it had been its own call. V may have its own head dim.
    """
    dv = v.shape[-1]
    q, k, v = (_pad_last(t, max(q.shape[-1], dv)) for t in (q, k, v))
    res = _compat.flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=softcap or 0.0, alibi_slopes=None, return_softmax=False,
    )
    return res[0][..., :dv], res[1]


def varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
    max_k: int, *, causal: bool, scale: float, softcap: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `varlen_forward`'s blocks given the merged `out` and `lse (H, Tq)` of each row."""
    dqk, dv_dim = q.shape[-1], v.shape[-1]
    width = max(dqk, dv_dim)
    q, k, v, dout, out = (_pad_last(t, width).contiguous() for t in (q, k, v, dout, out))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _compat.flash_attn_varlen_backward(
        dout, q, k, v, out, lse.contiguous(), dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
        softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1, softcap=softcap or 0.0,
        alibi_slopes=None, deterministic=True, rng_state=None,
    )
    return dq[..., :dqk], dk[..., :dqk], dv[..., :dv_dim]
