"""The delta-rule kernels under CP: Gated DeltaNet (`torch_chunk_gated_delta_rule`) and Kimi's KDA
(`chunk_kimi_delta_attention`).

Both follow flash-linear-attention's API, `(q, k, v, g, beta, chunk_size, initial_state,
output_final_state, use_qk_l2norm_in_kernel) -> (o, final_state)`, with a state `S`
`(batch, v_heads, dk, dv)` that each token updates as

    S <- (I - beta k k^T) D S + beta k v^T,    D = exp(g) (GDN: one scalar per head)
                                                   or diag(exp(g)) (KDA: one per key channel),

so a run's final state is `T @ init + final_0` with a `dk x dk` transition `T` per head,
acting on the state's dim -2 (`cpcompose.mixers.cp_chunked_recurrence`, kind "matrix").
`T` is what the kernel itself returns for the run's keys, gates and betas with `v = 0`
(value dim dk) from `initial_state = I`: the same kernel, the same key normalization
(`use_qk_l2norm_in_kernel`), the same float32 accumulation, and on CUDA fla's kernel
when it is installed, rather than a second implementation of the recurrence that could
drift from it. Used by Qwen3-Next, Qwen3.5 (dense and MoE), OLMo-Hybrid, LaraMini and Qwen4-Exp
(GDN), Kimi Linear, BailingHybrid and GLM-5.3 (KDA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from cpcompose.mixers.kernel_calls import needs_grad, tensor_fields, whole_pack_refusal
from cpcompose.mixers.chunked import cp_chunked_recurrence
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

    def kernel(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        return original(query[:, rows], key[:, rows], value[:, rows], g=g[:, rows], beta=beta[:, rows],
                        chunk_size=chunk_size, initial_state=init, output_final_state=True,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)  # type: ignore[no-any-return]

    def transition(rows: slice) -> Tensor:
        # With v = 0 the run adds nothing to the state, so from I it ends in T @ I = T.
        k, (batch, _, heads, dk) = key[:, rows], value.shape[:3] + key.shape[-1:]
        zero_v = value.new_zeros(batch, k.shape[1], heads, dk)
        eye = torch.eye(dk, dtype=torch.promote_types(value.dtype, torch.float32), device=value.device)
        _, t = original(query[:, rows], k, zero_v, g=g[:, rows], beta=beta[:, rows], chunk_size=chunk_size,
                        initial_state=eye.expand(batch, heads, dk, dk).contiguous(), output_final_state=True,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return t  # type: ignore[no-any-return]

    out = cp_chunked_recurrence(
        kernel, transition, mesh=region.mesh, layout=region.options.layout, seq_local=query.shape[1], kind="matrix",
        out_dim=1, what=what, device=query.device, dtype=query.dtype, grad=needs_grad(query, key, value, g, beta),
        signature=[*tensor_fields("query", query), *tensor_fields("value", value), *tensor_fields("g", g),
                   ("chunk_size", int(chunk_size)), ("use_qk_l2norm_in_kernel", int(bool(use_qk_l2norm_in_kernel)))],
        caller_error=error, meter=region.options.meter,
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
