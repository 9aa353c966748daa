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


def sdpa_baseline(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, *, causal: bool, scale: float, visible: Tensor | None = None,
    softcap: float | None = None,
) -> dict[str, Tensor]:
    """Output, LSE and gradients of full-sequence attention on `q`'s device and dtype, returned on the CPU.

    K/V heads are repeated before the kernel (the fused CUDA kernels have no GQA), so
    dK/dV come back summed over each group, with the K/V head count. A window
    (`visible`, the boolean `(S, S)` mask) goes to the memory-efficient kernel as an
    additive bias, whatever the dtype (PyTorch's flash kernel takes no mask), as
    cpcompose's window-edge blocks do; softcap and float64, which no fused PyTorch
    kernel has, use an explicit softmax in the input dtype through autograd. V with
    its own head dim is zero-padded for the fused kernels (zero columns change nothing).
    """
    half = q.dtype in (torch.float16, torch.bfloat16)
    q, k, v, dout = (t.detach().contiguous() for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if softcap is not None or q.dtype == torch.float64:
        s = q @ ke.transpose(-1, -2) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if visible is None and causal:
            visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        if visible is not None:
            s = s.masked_fill(~visible.to(q.device), float("-inf"))
        lse = torch.logsumexp(s.float(), -1)
        out = (torch.softmax(s.float(), -1).to(q.dtype) @ ve)
    else:
        width = max(q.shape[-1], v.shape[-1])
        qp, kp, vp = (F.pad(t, (0, width - t.shape[-1])) for t in (q, ke, ve))
        masked = visible is not None  # a window (`causal` then only says which side it bounds)
        bias = None
        if masked:
            bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~visible.to(q.device), float("-inf"))
        kernel = SDPBackend.EFFICIENT_ATTENTION if (masked or not half) else SDPBackend.FLASH_ATTENTION
        with sdpa_kernel([kernel]):
            out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=bias, is_causal=causal and not masked,
                                                 scale=scale)[..., : v.shape[-1]]
        with torch.no_grad():
            if kernel == SDPBackend.FLASH_ATTENTION:
                lse = torch.ops.aten._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, causal, False, scale=scale)[1]
            else:  # the efficient kernel pads the LSE to a multiple of 32 queries
                full_bias = None if bias is None else bias.expand(qp.shape[0], qp.shape[1], *bias.shape)
                lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                    qp, kp, vp, full_bias, True, 0.0, causal and not masked, scale=scale
                )[1][..., : q.shape[2]]
    out.backward(dout)
    grads = [t.grad for t in (q, k, v)]
    assert all(g is not None for g in grads)
    return {name: t.detach().cpu() for name, t in zip(("out", "lse", "dq", "dk", "dv"), [out, lse, *grads])}


def concat_baselines(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Per-document baselines joined along the sequence dim (2), as one pack."""
    return {name: torch.cat([p[name] for p in parts], dim=2) for name in parts[0]}
