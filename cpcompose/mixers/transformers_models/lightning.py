"""MiniMax's lightning attention under CP: linear attention with a constant decay per head, exact over the
global sequence.

`MiniMaxLightningAttention.forward` computes `o_t = q_t S_t`, `S_t = lambda * S_{t-1} + k_t^T v_t`
(`lambda = exp(-slope)` per head, `S` a `(head_dim, head_dim)` state per head) blockwise, inline
in the forward: an intra-block term with a decay mask and an inter-block term through the
state. There is no kernel function to route, so the forward is: its per-token code
(projections, activation, output norm, gate) through the module's own layers, and the scan
between them through `cpcompose.mixers.cp_chunked_recurrence`, each stretch scanned once, from
zero, by the loop transformers writes. A stretch's transition is `lambda ** length` per head
(kind "diagonal"), and its outputs are affine in its initial state: one that continues a
document gets `q_t lambda^(t+1) S_0` added (a `Correction`), no second scan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpcompose.mixers.api_checks import needs_grad, tensor_fields, whole_pack_refusal
from cpcompose.mixers.chunked import Correction, cp_chunked_recurrence
from cpcompose.mixers.region import Region

__all__ = ["cp_lightning_attention", "lightning_blocks"]

_NO_MASK = (
    "MiniMaxLightningAttention got a padding mask (a 2-D attention_mask given to the model): under CP express "
    "padding and documents with pack_batch and call the model without attention_mask"
)


def lightning_blocks(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, init: Tensor | None) -> tuple[Tensor, Tensor]:
    """Lightning attention over one stretch of tokens from state `init` (None: zero), as transformers' forward
    computes it: blocks of `module.block_size` from the stretch's start, each an intra-block term through
    the decay mask plus an inter-block term through the state entering the block.

    Args:
        module: the `MiniMaxLightningAttention` (its block size and decay buffers).
        q, k, v: `(batch, heads, length, head_dim)`.
        init: `(batch, heads, head_dim, head_dim)` or None.

    Returns:
        `(outputs (batch, heads, length, head_dim), final state)`.
    """
    batch, heads, length, dim = q.shape
    state = init if init is not None else q.new_zeros(batch, heads, dim, v.shape[-1])
    outputs = []
    for start in range(0, length, module.block_size):
        n = min(module.block_size, length - start)
        qb, kb, vb = q[:, :, start:start + n], k[:, :, start:start + n], v[:, :, start:start + n]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * module.diagonal_decay[:, :, :n, :n], vb)
        inter = torch.matmul(qb * module.query_decay[:, :n], state)
        outputs.append(inter + intra)
        kv = torch.matmul((kb * module.key_decay[:, -n:]).transpose(-1, -2), vb)
        state = state * torch.exp(-module.slope_rate * n) + kv
    return torch.cat(outputs, dim=-2), state


def cp_lightning_attention(
    original: Callable[..., Any], region: Region, self: nn.Module, hidden_states: Tensor,
    position_embeddings: object = None, attention_mask: Tensor | None = None, cache: object = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """`MiniMaxLightningAttention.forward` under CP: the state `(batch, heads, head_dim, head_dim)` passed
    between runs, every per-token step through the module's own layers.

    Returns:
        `(output (batch, seq_local, hidden), None)`: no state (transformers returns it for its cache,
        which CP refuses).
    """
    batch, seq_local, _ = hidden_states.shape
    heads, dim = self.num_attention_heads, self.head_dim
    cached = cache if cache is not None else kwargs.get("past_key_values")
    error = whole_pack_refusal("MiniMaxLightningAttention", {}, state=cached)
    if error is None and attention_mask is not None:
        error = _NO_MASK
    qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(batch, seq_local, heads, 3 * dim)
    q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, dim, dim=3))

    finals: dict[int, Tensor] = {}

    def kernel(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        out, final = lightning_blocks(self, q[:, :, rows], k[:, :, rows], v[:, :, rows], init)
        finals[rows.start] = final
        return out, final

    def transition(rows: slice) -> Tensor:
        return torch.exp(-self.slope_rate * (rows.stop - rows.start))[None].to(q.dtype)  # (1, heads, 1, 1)

    def correct(rows: slice, out: Tensor, init: Tensor) -> Tensor:
        # The state entering token t (from the stretch's start) holds init decayed t + 1 times: o_t += q_t l^(t+1) init.
        steps = torch.arange(1, rows.stop - rows.start + 1, device=q.device, dtype=q.dtype)[:, None]
        return out + torch.matmul(q[:, :, rows] * torch.exp(-self.slope_rate * steps).to(q.dtype), init)

    out = cp_chunked_recurrence(
        kernel, transition, mesh=region.mesh, layout=region.options.layout, seq_local=seq_local, kind="diagonal",
        out_dim=2, what="MiniMaxLightningAttention", device=hidden_states.device, dtype=q.dtype,
        grad=needs_grad(q, k, v), signature=[*tensor_fields("qkv", qkv), ("block_size", int(self.block_size))],
        caller_error=error, meter=region.options.meter,
        correction=Correction(final=lambda rows: finals[rows.start], apply=correct),
    )
    out = self.norm(out.transpose(1, 2).reshape(batch, seq_local, heads * dim))
    out = F.sigmoid(self.output_gate(hidden_states)) * out
    return self.out_proj(out), None
