"""Mamba's selective scan (`mamba_selective_scan`, mamba_ssm's `selective_scan_fn`) under CP.

Used by every Mamba-1 mixer transformers ships (Mamba, FalconMamba, Jamba, Zamba). The
API takes no initial state, so a run that continues a document cannot be rerun from its
true state. Its outputs are corrected instead: the state is diagonal,
`h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t`, so starting from `h0` adds
`exp(sum_{s<=t} delta_s A) h0` to each state and `C_t . (that)` to each output before
the gate (`cpcompose.mixers.Correction`).

The summaries (a run's transition and final state) and the correction are computed here
in torch from the kernel's inputs, not read from the kernel: mamba_ssm's
`selective_scan_fn` returns its last state without a gradient path (its backward drops
it), so a final state taken from it would silently cut the gradient between ranks. They
materialise `(batch, d_inner, run, d_state)`, as transformers' torch scan itself does.

Precision: they are computed in the inputs' accumulation dtype, float32 for bf16/fp16/fp32
(as mamba_ssm computes) and float64 for float64. transformers' torch scan reads u and B in
float32 even in a float64 call, so there the carried state is the more precise of the two
and CP agrees with the single-process run to float32 rounding, not float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cpcompose.mixers.decay import flushed_exp
from cpcompose.mixers.api_checks import needs_grad, tensor_fields, whole_pack_refusal
from cpcompose.mixers.chunked import Correction, cp_chunked_recurrence
from cpcompose.mixers.region import Region
from cpcompose.precision import accumulation_dtype

__all__ = ["cp_mamba_selective_scan"]


def _shape_error(u: Any, delta: Any, A: Any, B: Any, C: Any, z: Any) -> str | None:
    """Why the inputs are not the one form the CP version handles (transformers' torch scan's only form)."""
    named = {"hidden_states": u, "dt": delta, "A": A, "B": B, "C": C}
    if z is not None:
        named["z"] = z
    for name, t in named.items():
        if not isinstance(t, Tensor):
            return f"mamba_selective_scan: {name} must be a tensor, got {type(t).__name__}"
    if u.ndim != 3:
        return f"mamba_selective_scan: hidden_states must be (batch, d_inner, seq), got {tuple(u.shape)}"
    batch, d_inner, seq = u.shape
    for name in ("dt", "z"):
        if name in named and named[name].shape != u.shape:
            return (f"mamba_selective_scan: {name} must have hidden_states' shape {tuple(u.shape)}, "
                    f"got {tuple(named[name].shape)}")
    if A.ndim != 2 or A.shape[0] != d_inner or A.is_complex():
        return f"mamba_selective_scan: A must be real (d_inner={d_inner}, d_state), got {A.dtype} {tuple(A.shape)}"
    want = (batch, A.shape[1], seq)
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != want:
            return (f"mamba_selective_scan: {name} must be input-dependent (batch, d_state, seq) = {want}, got "
                    f"{tuple(t.shape)}; the grouped and input-independent forms have no CP version")
    return None


def cp_mamba_selective_scan(
    original: Callable[..., Any], region: Region, hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor,
    C: Tensor, D: Tensor | None = None, z: Tensor | None = None, delta_bias: Tensor | None = None,
    delta_softplus: bool = False, return_last_state: bool = False, **kwargs: Any,
) -> Tensor:
    """`selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus)` under CP, exact over the sequence.

    Each local run goes through the original kernel from a zero state (with D and the z
    gate, as the model asked: a run that starts a document is exactly the original's
    result); a run that continues one then gets `C_t . (exp(cumsum delta A)_t * h0)`
    times `silu(z_t)` added, `h0` its true initial state composed from every earlier
    run's `(exp(sum delta A), final state)`. delta is taken after its bias and softplus,
    as the kernel applies them; the summaries and the correction are in the kernel's
    precision or wider (float32 at least).

    Raises:
        ValueError: on every rank, if any rank asks for the last state (a generation
            cache), passes a whole pack's seq_idx/cu_seqlens, or passes another form of
            B/C (grouped, input-independent) or inconsistent shapes.
    """
    error = (whole_pack_refusal("mamba_selective_scan", kwargs, final=return_last_state)
             or _shape_error(hidden_states, dt, A, B, C, z))
    sums: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # per run, computed once for its three uses

    def summands(rows: slice) -> tuple[Tensor, Tensor]:
        """The run's delta `(batch, d_inner, run)` and `cumsum(delta A)` `(batch, d_inner, run, d_state)`."""
        if (rows.start, rows.stop) not in sums:
            acc = accumulation_dtype(torch.promote_types(dt.dtype, A.dtype))
            step = dt[..., rows] if delta_bias is None else dt[..., rows] + delta_bias.to(dt.dtype)[..., None]
            step = (F.softplus(step) if delta_softplus else step).to(acc)
            sums[rows.start, rows.stop] = step, torch.cumsum(step[..., None] * A.to(acc)[:, None, :], dim=2)
        return sums[rows.start, rows.stop]

    def kernel(rows: slice, init: Tensor | None) -> tuple[Tensor, None]:
        return original(hidden_states[..., rows], dt[..., rows], A, B[..., rows], C[..., rows], D=D,
                        z=None if z is None else z[..., rows], delta_bias=delta_bias, delta_softplus=delta_softplus,
                        return_last_state=False, **kwargs), None

    def transition(rows: slice) -> Tensor:
        return torch.exp(summands(rows)[1][..., -1, :])  # (batch, d_inner, d_state)

    def final(rows: slice) -> Tensor:
        step, cum = summands(rows)
        # Every token's input decays over the run's rest: exp(cum_end - cum_t) <= 1, no overflow.
        weight = flushed_exp(cum[..., -1:, :] - cum)
        return torch.einsum("bdln,bdl,bnl->bdn", weight, step * hidden_states[..., rows].to(step.dtype),
                            B[..., rows].to(step.dtype))

    def apply(rows: slice, out: Tensor, init: Tensor) -> Tensor:
        cum = summands(rows)[1]
        extra = torch.einsum("bdln,bdn,bnl->bdl", flushed_exp(cum), init.to(cum.dtype), C[..., rows].to(cum.dtype))
        if z is not None:
            extra = extra * F.silu(z[..., rows].to(cum.dtype))
        return (out.to(cum.dtype) + extra).to(out.dtype)

    return cp_chunked_recurrence(
        kernel, transition, mesh=region.mesh, layout=region.options.layout, seq_local=hidden_states.shape[-1],
        kind="diagonal", out_dim=-1, what="mamba_selective_scan", device=hidden_states.device,
        dtype=hidden_states.dtype, grad=needs_grad(hidden_states, dt, A, B, C, D, z, delta_bias),
        signature=[*tensor_fields("hidden_states", hidden_states), *tensor_fields("A", A), *tensor_fields("B", B)],
        caller_error=error, meter=region.options.meter, correction=Correction(final=final, apply=apply),
    )
