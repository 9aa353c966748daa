"""Mamba2's SSD scan (`mamba2_chunk_scan`, mamba_ssm's `mamba_chunk_scan_combined`) under CP.

Used by every Mamba2-style mixer transformers ships (Mamba2, Bamba, Falcon-H1,
GraniteMoeHybrid, Nemotron-H, Zamba2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from cpcompose.mixers.decay import decay_since_start
from cpcompose.mixers.api_checks import needs_grad, tensor_fields, whole_pack_refusal
from cpcompose.mixers.chunked import Correction, Stretch, cp_chunked_recurrence, token_pieces
from cpcompose.mixers.region import Region
from cpcompose.precision import accumulation_dtype

__all__ = ["cp_mamba2_chunk_scan"]


def cp_mamba2_chunk_scan(
    original: Callable[..., Any], region: Region, hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor,
    C: Tensor, chunk_size: int, D: Tensor | None = None, dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf), return_final_states: bool = False, **kwargs: Any,
) -> Tensor:
    """Mamba2's SSD scan (`mamba_chunk_scan_combined`'s API) under CP: the state passed between runs.

    The state `(batch, heads, head_dim, state)` decays by one scalar per head and token,
    `exp(dt * A)` after `dt`'s bias, softplus and clamp, as the kernel applies them; a run's
    transition is the product over its tokens (`cpcompose.mixers.cp_chunked_recurrence`).
    Each run goes through the kernel once, from zero; a run that continues a document then
    gets what its true initial state adds, `y_t += exp(sum_{s<=t} dt_s A) * (C_t . h0)`
    (the kernel's own inter-chunk term, in float32 or wider), instead of a second pass.

    The summaries travel in one gather. Two (`defer`, as the delta rule's) would let the
    middle zigzag rank run its second chunk from its true state instead of correcting it,
    but measured at P = 2, L = 4096 on a quiet 2-core machine the second gather's sync points
    cost more than the halved correction saved (T_P 151 against 145 ms in one gather, with the
    first gather anchored early: `states._Anchor`).
    """
    error = whole_pack_refusal("mamba2_chunk_scan", kwargs, state=initial_states, final=return_final_states)
    finals: dict[int, Tensor] = {}
    pieces: dict[int, tuple[Tensor, ...]] = {}  # a stretch's first row -> its (hidden_states, dt, B, C)

    def plan(spans: Sequence[Stretch]) -> None:
        pieces.update(token_pieces(spans, hidden_states, dt, B, C))

    def kernel(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        x_rows, dt_rows, b_rows, c_rows = pieces[rows.start]
        out, final = original(x_rows, dt_rows, A, b_rows, c_rows, chunk_size, D=D, dt_bias=dt_bias,
                              initial_states=init, dt_softplus=dt_softplus, dt_limit=dt_limit,
                              return_final_states=True)
        finals[rows.start] = final
        return out, final

    acc = accumulation_dtype(hidden_states.dtype)  # float32 at least, as the kernel; float64 stays float64

    def log_decay(rows: slice) -> Tensor:
        """`dt * A` per token and head of the run, `(batch, run, heads)`, as the kernel computes it."""
        step = pieces[rows.start][1]
        step = step if dt_bias is None else step + dt_bias.to(dt.dtype)
        step = torch.clamp(F.softplus(step) if dt_softplus else step, min=dt_limit[0], max=dt_limit[1])
        return step.to(acc) * A.to(acc)

    def transition(rows: slice) -> Tensor:
        return torch.exp(log_decay(rows).sum(dim=1))[..., None, None]  # (batch, heads, 1, 1)

    def correct(rows: slice, out: Tensor, init: Tensor) -> Tensor:
        (batch, _, heads, dim), groups = out.shape, C.shape[2]
        # Each group's C reads the states of its heads in one product (no per-head copy of C).
        grouped = init.to(acc).reshape(batch, groups, heads // groups, dim, init.shape[-1])
        decay = decay_since_start(log_decay(rows), dim=1)[..., None]
        return _CarriedIn.apply(out, pieces[rows.start][3].to(acc), grouped, decay)

    return cp_chunked_recurrence(
        kernel, transition, mesh=region.mesh, layout=region.options.layout, seq_local=hidden_states.shape[1],
        kind="diagonal", out_dim=1, what="mamba2_chunk_scan", device=hidden_states.device,
        dtype=hidden_states.dtype, grad=needs_grad(hidden_states, dt, A, B, C, D, dt_bias),
        signature=[*tensor_fields("hidden_states", hidden_states), *tensor_fields("B", B),
                   ("chunk_size", int(chunk_size))],
        caller_error=error, meter=region.options.meter,
        correction=Correction(final=lambda rows: finals[rows.start], apply=correct), plan=plan,
    )


class _CarriedIn(torch.autograd.Function):
    """A run's outputs plus what its incoming state adds, `out + decay * (C . h0)`, differentiable in all four.

    `(out (batch, run, heads, dim), C (batch, run, groups, state), h0 (batch, groups, heads/groups, dim,
    state), decay (batch, run, heads, 1))`; `C`, `h0` and `decay` in the accumulation dtype.

    Written out for its memory traffic: on a CPU a fresh shard-sized buffer costs more in page
    faults than the arithmetic that fills it. The readout `C . h0` is scaled and summed into its own
    buffer (one shard-sized buffer forward, where `addcmul` takes two) and is not kept for the
    backward, which instead reads the output gradient through the state once, `G = grad . h0`
    (batch, run, heads, state): `C`'s gradient and the decay's are small contractions of `G`.
    Measured alone on 2,048 tokens a rank, forward and backward with `C` a strided view as the conv
    gives it: 10.5 ms against autograd's 13.2 (docs/benchmarks/mixers.md).
    """

    @staticmethod
    def forward(ctx: Any, out: Tensor, c: Tensor, h0: Tensor, decay: Tensor) -> Tensor:
        batch, length, heads, dim = out.shape
        c = c.contiguous()  # often a strided view of the conv's output: the backward's small contractions want rows
        carried = torch.einsum("blgn,bgkpn->blgkp", c, h0).reshape(batch, length, heads, dim).mul_(decay)
        ctx.save_for_backward(c, h0, decay)
        return carried.add_(out) if out.dtype == carried.dtype else out + carried.to(out.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        c, h0, decay = ctx.saved_tensors
        # (batch, run, groups, heads/groups, dim); reshape, not view: whatever strides the gradient arrives with
        wide = grad.to(c.dtype).reshape(*c.shape[:3], *h0.shape[2:4])
        per_head = decay.reshape(wide.shape[:4])
        through = torch.einsum("blgkp,bgkpn->blgkn", wide, h0)  # the gradient read through the state
        grad_c = torch.einsum("blgkn,blgk->blgn", through, per_head) if ctx.needs_input_grad[1] else None
        grad_h0 = (torch.einsum("blgkp,blgn->bgkpn", wide * per_head[..., None], c)
                   if ctx.needs_input_grad[2] else None)
        grad_decay = (torch.einsum("blgkn,blgn->blgk", through, c).reshape(decay.shape)
                      if ctx.needs_input_grad[3] else None)
        return grad if ctx.needs_input_grad[0] else None, grad_c, grad_h0, grad_decay
