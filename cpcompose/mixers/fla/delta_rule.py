"""The delta-rule kernels under CP: Gated DeltaNet (`torch_chunk_gated_delta_rule`) and Kimi's KDA
(`chunk_kimi_delta_attention`).

Both follow flash-linear-attention's API, `(q, k, v, g, beta, chunk_size, initial_state,
output_final_state, use_qk_l2norm_in_kernel) -> (o, final_state)`, with a state `S`
`(batch, v_heads, dk, dv)` that each token updates as

    S <- (I - beta k k^T) D S + beta k v^T,    D = exp(g) (GDN: one scalar per head)
                                                   or diag(exp(g)) (KDA: one per key channel),

so a stretch's final state is `T @ init + final_0` with a `dk x dk` transition `T` per head,
acting on the state's dim -2 (`cpcompose.mixers.cp_chunked_recurrence`, kind "matrix"), and
its outputs are affine in `init` too: `o_t = o_t^0 + init^T (A_t^T q_t)`, `A_t` the product of
the token transitions so far (`T = A_last`).

One pass per stretch, exact: a stretch that continues a document goes through the kernel
once with the values widened by dk zero columns and the initial state `[0 | I]`. The state's
first dv columns are then the zero-state run (outputs `o^0`, final `final_0`); its last dk
columns start from the identity and receive nothing (their values are zero), so they end in
`T` and read out `A_t^T q_t` at every token, the correction's readout. The same kernel,
the same key normalization (`use_qk_l2norm_in_kernel`), the same float32 accumulation, and on
CUDA fla's kernel when it is installed, rather than a second implementation of the
recurrence that could drift from it. The price is a value width dv + dk instead of dv on
those stretches (the parts of the kernel that read the state or the values; the chunk-local
key products and the triangular solve for the keys are shared), and only on the stretches of
documents that cross a rank boundary: a stretch that starts its document runs as one process
would. (flash-linear-attention's KCP spends a state-only pass and then a real pass from the
true state instead: two passes, and the second waits for the states.)

A stretch whose true initial state one gather of the ranks' first stretches already settles
is not widened at all: it waits for that gather and runs plainly from its true state (two
gathers, `cpcompose.mixers.stretch_plan.phased_stretches`). Under zigzag that is the middle
rank's second chunk, so at P = 2 each rank runs one plain and one widened chunk.
Used by Qwen3-Next, Qwen3.5 (dense and MoE), OLMo-Hybrid, LaraMini and Qwen4-Exp
(GDN), Kimi Linear, BailingHybrid and GLM-5.3 (KDA).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from cpcompose.mixers.api_checks import needs_grad, tensor_fields, whole_pack_refusal
from cpcompose.mixers.chunked import Correction, Stretch, cp_chunked_recurrence
from cpcompose.mixers.region import Region

__all__ = ["cp_chunk_gated_delta_rule", "cp_chunk_kimi_delta_attention"]


def _shape_error(what: str, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, per_channel: bool
                 ) -> str | None:
    """Why the inputs are not the API's shapes (checked here, so every rank raises alike), or None."""
    if q.ndim != 4 or k.shape != q.shape:
        return (f"{what}: query and key must be (batch, seq, k_heads, dk) of one shape, got {tuple(q.shape)} "
                f"and {tuple(k.shape)}")
    heads = q.shape[2]
    grouped = v.ndim == 4 and heads > 0 and (v.shape[2] == heads if per_channel else v.shape[2] % heads == 0)
    if not grouped or v.shape[:2] != q.shape[:2]:
        want = "k_heads" if per_channel else "a multiple of k_heads"
        return f"{what}: value must be (batch, seq, {want}, dv) beside query {tuple(q.shape)}, got {tuple(v.shape)}"
    gate = (*v.shape[:3], k.shape[3]) if per_channel else v.shape[:3]
    if g.shape != gate or beta.shape != v.shape[:3]:
        return (f"{what}: g must be {tuple(gate)} and beta {tuple(v.shape[:3])}, got {tuple(g.shape)} and "
                f"{tuple(beta.shape)}")
    return None


def _cp_delta_rule(
    what: str, per_channel: bool, original: Callable[..., Any], region: Region, query: Tensor, key: Tensor,
    value: Tensor, g: Tensor, beta: Tensor, chunk_size: int, initial_state: Tensor | None, output_final_state: bool,
    use_qk_l2norm_in_kernel: bool, kwargs: dict[str, Any],
) -> tuple[Tensor, None]:
    """Either delta rule under CP: `per_channel` says whether `g` has a key-channel dim (KDA) or not (GDN)."""
    error = whole_pack_refusal(what, kwargs, state=initial_state, final=output_final_state)
    error = error or _shape_error(what, query, key, value, g, beta, per_channel)

    dv = value.shape[-1]
    continuing: set[int] = set()  # the first rows of the stretches that continue a document and are widened
    readouts: dict[int, Tensor] = {}  # per such stretch: A_t^T q_t (batch, run, v_heads, dk)
    transitions: dict[int, Tensor] = {}  # ... and its T (batch, v_heads, dk, dk)
    finals: dict[int, Tensor] = {}

    def plan(spans: Sequence[Stretch]) -> None:
        continuing.update(span.rows.start for span in spans if span.continues and not span.deferred)

    def run(rows: slice, v: Tensor, init: Tensor | None) -> tuple[Tensor, Tensor]:
        return original(query[:, rows], key[:, rows], v, g=g[:, rows], beta=beta[:, rows], chunk_size=chunk_size,
                        initial_state=init, output_final_state=True,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)  # type: ignore[no-any-return]

    def kernel(rows: slice, init: Tensor | None) -> tuple[Tensor, None]:
        v = value[:, rows]
        if rows.start not in continuing:
            out, finals[rows.start] = run(rows, v, init)
            return out, None
        (batch, length, heads), dk = v.shape[:3], key.shape[-1]
        state_dtype = torch.promote_types(value.dtype, torch.float32)  # the kernels' states: float32 at least
        eye = torch.eye(dk, dtype=state_dtype, device=value.device).expand(batch, heads, dk, dk)
        start = torch.cat([eye.new_zeros(batch, heads, dk, dv), eye], dim=-1)
        out, end = run(rows, torch.cat([v, v.new_zeros(batch, length, heads, dk)], dim=-1), start)
        readouts[rows.start], transitions[rows.start], finals[rows.start] = out[..., dv:], end[..., dv:], end[..., :dv]
        return out[..., :dv], None

    def correct(rows: slice, out: Tensor, init: Tensor) -> Tensor:
        readout = readouts[rows.start]
        return out + torch.einsum("bthk,bhkv->bthv", readout, init.to(readout.dtype)).to(out.dtype)

    out = cp_chunked_recurrence(
        kernel, lambda rows: transitions[rows.start], mesh=region.mesh, layout=region.options.layout,
        seq_local=query.shape[1], kind="matrix",
        out_dim=1, what=what, device=query.device, dtype=query.dtype, grad=needs_grad(query, key, value, g, beta),
        signature=[*tensor_fields("query", query), *tensor_fields("value", value), *tensor_fields("g", g),
                   ("chunk_size", int(chunk_size)), ("use_qk_l2norm_in_kernel", int(bool(use_qk_l2norm_in_kernel)))],
        caller_error=error, meter=region.options.meter,
        correction=Correction(final=lambda rows: finals[rows.start], apply=correct), plan=plan, defer=True,
    )
    return out, None


def cp_chunk_gated_delta_rule(
    original: Callable[..., Any], region: Region, query: Tensor, key: Tensor, value: Tensor, g: Tensor,
    beta: Tensor, chunk_size: int = 64, initial_state: Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, **kwargs: Any,
) -> tuple[Tensor, None]:
    """`torch_chunk_gated_delta_rule` (fla's `chunk_gated_delta_rule`) under CP: Gated DeltaNet.

    q, k `(batch, seq, k_heads, dk)`, v `(batch, seq, v_heads, dv)` (v_heads a multiple of
    k_heads: grouped values), g and beta `(batch, seq, v_heads)`. Returns `(o, None)`: a
    final state belongs to a generation cache, which CP refuses.
    """
    return _cp_delta_rule("torch_chunk_gated_delta_rule", False, original, region, query, key, value, g, beta,
                          chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel, kwargs)


def cp_chunk_kimi_delta_attention(
    original: Callable[..., Any], region: Region, query: Tensor, key: Tensor, value: Tensor, g: Tensor,
    beta: Tensor, chunk_size: int = 64, initial_state: Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, **kwargs: Any,
) -> tuple[Tensor, None]:
    """`chunk_kimi_delta_attention` (fla's `chunk_kda`) under CP: Kimi Delta Attention.

    q, k, v `(batch, seq, heads, d)`, g `(batch, seq, heads, dk)` (a log-decay per key
    channel), beta `(batch, seq, heads)`. Returns `(o, None)`, as the GDN version does.
    """
    return _cp_delta_rule("chunk_kimi_delta_attention", True, original, region, query, key, value, g, beta,
                          chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel, kwargs)
