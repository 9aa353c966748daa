"""Hugging Face transformers models under CP: `attn_implementation="cpcompose"`.

Importing this module registers "cpcompose" with transformers' attention interface
and with its mask interface. A user's whole change to a training step:

    import cpcompose.integrations.transformers as cphf
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cpcompose")
    batch = cphf.pack_batch(input_ids, mesh, attention_mask=attention_mask)
    with context_parallel(mesh, buffers=batch.buffers, buffer_seq_dims=batch.seq_dims, layout=batch.layout):
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        loss = cp_cross_entropy(logits, batch.labels, mesh=mesh)
        loss.backward()
    allreduce_gradients(model, mesh)  # or FSDP over dp x cp

Why it is exact: transformers builds its masks from what one rank holds, which under
CP is a shard (zigzag positions even look like packed documents to it). So inside a
CP region the mask hook builds no mask, and the attention function takes everything
from global information: causality, the sliding window (two-sided on bidirectional
local layers), softcap and scale from the attention module (per layer), documents
and padding from the layout the buffers were sharded with (`pack_batch`), K/V heads
and V's head dim as they are (GQA is never expanded before sending).
Whatever a rank cannot honour (a padding mask, a custom mask overlay, dropout, a
KV cache, positions that do not match the split, ...) becomes its complaint in the
cross-rank agreement, so every rank raises it together before any K/V moves.

Outside a CP region "cpcompose" is transformers' "sdpa" (its mask and its attention;
softcapped models get an explicit softmax), so the same model object also runs,
evaluates and generates on one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # an optional dependency: say which extra brings it
    raise ImportError(
        f"cpcompose.integrations.transformers needs transformers>=4.56 (pip install 'cpcompose[hf]'): {e}"
    ) from e

from cpcompose import _compat
from cpcompose.comm import CPGroup
from cpcompose.integrations._hf_batch import PackedBatch, cu_seqlens_from_position_ids, pack_batch, shift_labels
from cpcompose.layouts import Layout, PackedLayout
from cpcompose.parallel.dispatch import CPAttentionMode, active_cp_region

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PackedBatch",
    "cpcompose_attention_forward",
    "cpcompose_mask",
    "cu_seqlens_from_position_ids",
    "hf_window",
    "pack_batch",
    "shift_labels",
]

ATTN_IMPLEMENTATION = "cpcompose"
"""The name to pass as `attn_implementation=` (registered on import)."""

_UNDER_CP_ATTR = "_cpcompose_forward_under_cp"  # set on attention modules by each forward
_REFUSAL_ATTR = "_cpcompose_refusal"  # set on the marker mask the hook returns for what CP cannot honour
_FLASH_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def hf_window(sliding_window: int | None, causal: bool) -> tuple[int, int] | None:
    """transformers' `sliding_window=W` as flash-attn's `(left, right)`.

    transformers counts the query itself: query i sees keys i-W+1 .. i (causal), or
    |i - j| <= W-1 (bidirectional local layers: Gemma 3's, and ModernBERT's, whose
    module stores its config's half-window + 1). Its flash-attention path passes
    `(W-1, W-1)`, its eager/sdpa masks agree (checked in tests/integrations/test_transformers.py).
    """
    if sliding_window is None:
        return None
    left = int(sliding_window) - 1
    return (left, 0) if causal else (left, left)


def cpcompose_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """transformers' mask-interface entry for "cpcompose".

    Outside a CP region: transformers' sdpa mask. Inside: no mask (None), or, for what
    a local shard cannot express (padding, a custom mask overlay), a marker that the
    attention function refuses on every rank.
    """
    if active_cp_region() is None:
        return sdpa_mask(*args, **kwargs)
    padding, local_size = kwargs.get("attention_mask"), kwargs.get("local_size")
    if local_size is not None and local_size != getattr(kwargs.get("config"), "sliding_window", None):
        reason = (
            f"the model builds a local mask of size {local_size} that is not its config's sliding_window "
            "(e.g. chunked attention, attention_chunk_size), which its attention layers do not pass on"
        )
    elif kwargs.get("use_vmap"):
        reason = (
            "the model combines its mask with a custom mask function (or_mask_function/and_mask_function, "
            "e.g. image-token or bidirectional overlays), which CP attention cannot read from a shard"
        )
    elif isinstance(padding, Tensor) and not bool(padding.all()):
        reason = (
            "attention_mask has padding (zeros); a rank holds only a shard, so it cannot place them in the "
            "global sequence: build the batch with cpcompose.integrations.transformers.pack_batch (rows "
            "become documents, padding carries no loss), or pass no attention_mask"
        )
    else:
        return None
    marker = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    setattr(marker, _REFUSAL_ATTR, reason)
    return marker


def cpcompose_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-interface entry for "cpcompose".

    Args:
        module: the attention module (its `is_causal` decides causality unless `is_causal` is given).
        query, key, value: `(batch, heads, seq_local, head_dim)`; K/V may have fewer heads.
        attention_mask: what `cpcompose_mask` returned (None inside a CP region).
        dropout, scaling, sliding_window, softcap, is_causal: as transformers passes them.
        **kwargs: the rest of transformers' attention kwargs (`position_ids`, ...).

    Returns:
        `(output (batch, seq_local, heads, head_dim_v), None)`: no attention weights.

    Raises:
        ValueError: on every CP rank, before any K/V moves, naming what cannot be honoured.
    """
    region = active_cp_region()
    if region is None and _compat.in_backward() and getattr(module, _UNDER_CP_ATTR, False):
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): a checkpointed forward that ran "
            "under CP is being recomputed outside its CP region; enable checkpointing with activation_checkpointing_"
            "kwargs={'use_reentrant': False, 'context_fn': cpcompose.parallel.recompute_context}"
        )
    if not _compat.in_backward():
        setattr(module, _UNDER_CP_ATTR, region is not None)  # what a recomputation of this call must reproduce
    if region is None:
        return _single_process(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap,
            is_causal=is_causal, **kwargs,
        )
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = hf_window(sliding_window, causal)
    error = (
        _mask_refusal(attention_mask)
        or _feature_refusal(query, key, dropout, region, kwargs)
        or _position_refusal(kwargs.get("position_ids"), region, query)
    )
    if error:
        error = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): {error}"
    out = region.attend(query, key, value, is_causal=causal, scale=scaling, softcap=softcap, caller_error=error,
                        window_size=None if error else window)
    return out.transpose(1, 2).contiguous(), None


def _mask_refusal(attention_mask: object) -> str | None:
    if attention_mask is None:
        return None
    reason = getattr(attention_mask, _REFUSAL_ATTR, None)
    if reason:
        return reason
    return (
        "got a mask tensor (a 4-D attention_mask given to the model, or a mask "
        "built outside the CP region, e.g. with ContextParallel on the attention modules only): run the whole "
        "forward inside cpcompose.context_parallel, and express padding and documents with pack_batch"
    )


def _feature_refusal(
    query: Tensor, key: Tensor, dropout: float, region: CPAttentionMode, kwargs: dict[str, Any]
) -> str | None:
    """What this call asks that CP attention cannot honour, named as transformers names it, or None."""
    if dropout:
        return (
            f"attention dropout (dropout={dropout}: the model is in training mode with attention_dropout > 0) is "
            "not supported under CP; set config.attention_dropout = 0"
        )
    if key.shape[2] != query.shape[2]:
        return (
            f"a KV cache (keys hold {key.shape[2]} tokens, queries {query.shape[2]}) cannot be split across CP "
            "ranks; call the model with use_cache=False and no past_key_values"
        )
    for name, what in (("s_aux", "attention sinks"), ("position_bias", "an additive position bias")):
        if kwargs.get(name) is not None:
            return f"{what} ({name}=...) is not supported by CP attention"
    if any(kwargs.get(name) is not None for name in _FLASH_VARLEN_KWARGS):
        return (
            "flash-attention varlen kwargs (cu_seq_lens_q/k, max_length_q/k) describe the whole pack, not a shard; "
            "pass packed documents as position_ids restarting at 0 through pack_batch instead"
        )
    if region.options.window_size is not None:
        return (
            f"context_parallel(..., window_size={region.options.window_size}) with a Hugging Face model: the "
            "window comes from each attention layer (config.sliding_window); leave window_size unset"
        )
    return None


def _position_refusal(position_ids: object, region: CPAttentionMode, query: Tensor) -> str | None:
    """Why the model's `position_ids` are not this rank's positions under the region's split, or None.

    Without them as a buffer, transformers numbers each shard from 0 and RoPE is silently
    wrong; with zigzag positions over a pack, attention would cross documents.
    """
    layout = region.layout()
    local_len = query.shape[2]
    if not isinstance(position_ids, Tensor) or layout is None or layout.local_len_error(local_len):
        return None
    if position_ids.shape[-1] != local_len:
        return (
            f"position_ids cover {position_ids.shape[-1]} tokens but this rank holds {local_len}: pass the full "
            "position_ids as a context_parallel buffer"
        )
    rank = CPGroup.from_mesh(region.mesh).rank
    expected = layout.position_ids(rank, local_len * layout.world, position_ids.device)
    checked = _non_padding(layout, rank, position_ids.device)
    if bool(((position_ids.reshape(-1, local_len) == expected) | ~checked).all()):
        return None
    return (
        f"position_ids are not the positions of this rank's tokens under the {layout.name} split "
        f"(expected {expected[:8].tolist()}..., got {position_ids.reshape(-1, local_len)[0, :8].tolist()}...): "
        "pass the full position_ids (torch.arange(seq_len); for packed documents, restarting at 0 per document "
        "with pack_batch's PackedLayout) as a context_parallel buffer"
    )


def _non_padding(layout: Layout, rank: int, device: torch.device) -> Tensor:
    """Which local tokens are not a PackedLayout's padding document (whose positions change no result)."""
    if not isinstance(layout, PackedLayout) or not layout.pad:
        return torch.ones((), dtype=torch.bool, device=device)
    return layout.local_indices(rank, device=device) < layout.seq_len - layout.pad


def _single_process(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
    dropout: float, scaling: float | None, softcap: float | None, is_causal: bool | None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """Outside a CP region: transformers' sdpa; an explicit softmax where logits are softcapped or masked.

    The explicit path fills masked scores with the dtype's minimum as transformers' eager
    does: SDPA's math kernel turns a fully masked row (a padding query under a sliding
    window) into NaN, which then reaches real tokens through the next layer's 0 * NaN.
    """
    if softcap is None and attention_mask is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = query @ key.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None and causal and query.shape[2] > 1:
        attention_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:  # an additive float mask given by the caller
        scores = scores + attention_mask
    probs = torch.nn.functional.dropout(scores.softmax(dim=-1), p=dropout, training=dropout > 0)
    return (probs @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, cpcompose_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, cpcompose_mask)
