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

from cpcompose.mixers.decay import decay_since_start
from cpcompose.mixers.kernel_calls import needs_grad, tensor_fields, whole_pack_refusal
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
        (batch, length, heads, dim), groups = out.shape, C.shape[2]
        # Each group's C reads the states of its heads in one product (no per-head copy of C).
        grouped = init.to(acc).reshape(batch, groups, heads // groups, dim, init.shape[-1])
        c_rows = pieces[rows.start][3].to(acc)
        carried = torch.einsum("blgn,bgkpn->blgkp", c_rows, grouped).reshape(batch, length, heads, dim)
        decay = decay_since_start(log_decay(rows), dim=1)[..., None]
        if out.dtype == acc:  # one pass over the outputs: out + carried * decay
            return torch.addcmul(out, carried, decay)
        return out + (carried * decay).to(out.dtype)

    return cp_chunked_recurrence(
        kernel, transition, mesh=region.mesh, layout=region.options.layout, seq_local=hidden_states.shape[1],
        kind="diagonal", out_dim=1, what="mamba2_chunk_scan", device=hidden_states.device,
        dtype=hidden_states.dtype, grad=needs_grad(hidden_states, dt, A, B, C, D, dt_bias),
        signature=[*tensor_fields("hidden_states", hidden_states), *tensor_fields("B", B),
                   ("chunk_size", int(chunk_size))],
        caller_error=error, meter=region.options.meter,
        correction=Correction(final=lambda rows: finals[rows.start], apply=correct), plan=plan,
    )
