"""Single-process SDPA on the device a CP case ran on: the error baseline for CUDA cases.

The parity rule is "a CP result is at most 2x (RMS) / 4x (max) as far from the
float64 reference as one process running the same kind of kernel in the same
dtype". On CPU that process is the parent's CPU SDPA. On CUDA the kernels differ
(flash for bf16/fp16, memory-efficient for fp32, as `select_backend` picks), and
the parent must not touch CUDA (its forks could not), so a CUDA worker computes
this baseline with PyTorch's own SDPA pinned to that kernel, and returns it on the
CPU. The float64 reference stays in the parent, on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel


def sdpa_baseline(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, *, causal: bool, scale: float) -> dict[str, Tensor]:
    """Output, LSE and gradients of full-sequence SDPA on `q`'s device and dtype, returned on the CPU.

    K/V heads are repeated before the kernel (the fused CUDA kernels have no GQA), so
    dK/dV come back summed over each group, with the K/V head count.
    """
    half = q.dtype in (torch.float16, torch.bfloat16)
    q, k, v, dout = (t.detach().contiguous() for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION if half else SDPBackend.EFFICIENT_ATTENTION]):
        out = F.scaled_dot_product_attention(q, ke, ve, is_causal=causal, scale=scale)
    out.backward(dout)
    with torch.no_grad():
        if half:
            lse = torch.ops.aten._scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal, False, scale=scale)[1]
        else:  # the efficient kernel pads the LSE to a multiple of 32 queries
            lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, ke, ve, None, True, 0.0, causal, scale=scale
            )[1][..., : q.shape[2]]
    grads = [t.grad for t in (q, k, v)]
    assert all(g is not None for g in grads)
    return {name: t.detach().cpu() for name, t in zip(("out", "lse", "dq", "dk", "dv"), [out, lse, *grads])}


def concat_baselines(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Per-document baselines joined along the sequence dim (2), as one pack."""
    return {name: torch.cat([p[name] for p in parts], dim=2) for name in parts[0]}
