"""Hugging Face attention under CP: the "cpcompose" attention and mask functions.

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
and padding from the layout the buffers were sharded with (`pack_batch`), or padding
as a per-row key mask that travels with K/V (an attention_mask given as a buffer: its
shard is cut like the keys), K/V heads and V's head dim as they are (GQA is never
expanded before sending).
Whatever a rank cannot honour (a padding mask not given as a buffer, a custom mask overlay, dropout, a
KV cache, positions that do not match the split, ...) becomes its complaint in the
cross-rank agreement, so every rank raises it together before any K/V moves.

Under torch.compile (each decoder layer compiled inside a region entered outside it: the trainer's
`training.compile`), the same function is traced: what it reads from the region and the call is fixed
while dynamo traces, a layer's window becomes a constant of the `cpcompose::attention` op call, and the
positions check, which reads tensor values, runs inside the op at run time, joining the agreement.

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
from cpcompose.attention.sparse.call import attend_selected
from cpcompose.comm import CPGroup, rehearsing
from cpcompose.integrations.transformers.implementation import ATTN_IMPLEMENTATION
from cpcompose.integrations.transformers.indexer import INDEXED_FAMILIES
from cpcompose.layouts import position_ids_error
from cpcompose.parallel.dispatch import CPAttentionMode, active_cp_region

__all__ = ["ATTN_IMPLEMENTATION", "OWN_ATTENTION", "cpcompose_attention_forward", "cpcompose_mask", "hf_window"]

OWN_ATTENTION = {
    "mpt": (
        "MPT computes attention in its own code (an explicit softmax with an ALiBi bias), not through "
        "transformers' attention interface, so attn_implementation='cpcompose' cannot reach it, and cpcompose "
        "has no ALiBi: on one process build MPT with attn_implementation='eager'; under CP it is not supported"
    ),
}
"""Model types whose attention never calls the attention interface: refused where their mask is built."""

_UNDER_CP_ATTR = "_cpcompose_forward_under_cp"  # set on attention modules by each forward
_REFUSAL_ATTR = "_cpcompose_refusal"  # set on the marker mask the hook returns for what CP cannot honour
_NO_MASK_ATTR = "_cpcompose_no_mask"  # set on the marker that stands for "no mask" where a model slices its mask
_KEY_PADDING_ATTR = "_cpcompose_key_padding"  # set on the marker carrying this rank's per-row key mask
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

    Outside a CP region: transformers' sdpa mask. Inside: no mask (None); for padding that
    masks keys per row, a marker carrying this rank's key mask (`key_padding`); for what
    CP cannot express (a custom mask overlay, ...), a marker that the attention function
    refuses on every rank.
    """
    own = OWN_ATTENTION.get(getattr(kwargs.get("config"), "model_type", None))
    if own is not None:  # raised where transformers builds the mask: before any layer, on every rank alike
        raise ValueError(own)
    region = active_cp_region()
    if region is None:
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
    elif isinstance(padding, Tensor):
        reason = _padding_route(padding, region.full_buffer(padding), kwargs.get("mask_function"))
        if reason is None:
            return _no_mask(kwargs)
        if isinstance(reason, Tensor):  # keys masked per row: the marker carries this rank's key mask
            marker = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=kwargs.get("device", "cpu"))
            setattr(marker, _KEY_PADDING_ATTR, reason)
            return marker
    else:
        return _no_mask(kwargs)
    marker = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    setattr(marker, _REFUSAL_ATTR, reason)
    return marker


def _no_mask(kwargs: dict[str, Any]) -> Tensor | None:
    """None, or for a DSA family (whose attention slices its mask for the indexer) a marker meaning "no mask".

    The indexer itself is given the global row's mask (`indexer.py`); the attention reads the layout.
    """
    family = type(kwargs.get("config")).__module__.split(".")
    if len(family) < 3 or family[2] not in INDEXED_FAMILIES:
        return None
    marker = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    setattr(marker, _NO_MASK_ATTR, True)
    return marker


def _padding_route(shard: Tensor, full: Tensor | None, mask_function: object) -> str | Tensor | None:
    """How a padding mask is honoured under CP: None (no mask needed), this rank's key mask, or why it cannot be.

    Given as a `context_parallel` buffer, the mask's full contents are known on every rank
    (the region keeps them), and this rank's shard is cut by the same layout as its keys.
    Right padding under a causal mask is then exact with no mask at all: every real token
    comes before its row's padding, so no real token attends to a padding key (padding
    positions' own outputs carry no loss, as with transformers' padding). Anything else
    (left or inner padding, padding in a bidirectional model) masks keys per row: the shard
    is returned as `cp_attention`'s `key_padding`, which travels with this rank's K/V.
    """
    pack = "build the batch with cpcompose.integrations.transformers.pack_batch (each row's real tokens become a " \
           "document and the padding is dropped)"
    if full is None:
        if bool(shard.all()):
            return None
        return ("attention_mask has padding (zeros) but is not a context_parallel buffer, so no rank knows where "
                f"the others' zeros lie: pass it in buffers=, or {pack}")
    if bool(full.all()):
        return None
    if full.ndim != 2:
        return f"attention_mask of shape {tuple(full.shape)} is not a (batch, seq) padding mask: {pack}"
    right_padded = bool((full[:, 1:] <= full[:, :-1]).all())
    if right_padded and _is_causal(mask_function):
        return None
    return shard.bool()


def _is_causal(mask_function: object) -> bool:
    """Whether transformers' mask function hides the next key from a query (causal and sliding-window causal)."""
    if not callable(mask_function):
        return False
    zero, one = torch.tensor(0), torch.tensor(1)
    return not bool(mask_function(zero, zero, zero, one)) and bool(mask_function(zero, zero, one, zero))


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
    indices = kwargs.pop("indices", None)  # DSA's top-k key positions per query (an indexer's choice), or None
    region = active_cp_region()
    compiling = torch.compiler.is_compiling()
    if region is None and _compat.in_backward() and getattr(module, _UNDER_CP_ATTR, False):
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): a checkpointed forward that ran "
            "under CP is being recomputed outside its CP region; enable checkpointing with activation_checkpointing_"
            "kwargs={'use_reentrant': False, 'context_fn': cpcompose.parallel.recompute_context}"
        )
    if not _compat.in_backward():
        setattr(module, _UNDER_CP_ATTR, region is not None)  # what a recomputation of this call must reproduce
    if region is None:
        if isinstance(indices, Tensor):
            attention_mask = _selected_mask(attention_mask, indices, query, key, module, is_causal)
        return _single_process(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap,
            is_causal=is_causal, **kwargs,
        )
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = hf_window(sliding_window, causal)
    error = (
        _mask_refusal(attention_mask)
        or _feature_refusal(query, key, dropout, region, kwargs)
        or (None if compiling else _position_refusal(kwargs.get("position_ids"), region, query))
    )
    if error:
        error = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): {error}"
    key_padding = getattr(attention_mask, _KEY_PADDING_ATTR, None)
    if error is None and key_padding is not None and softcap is not None:
        error = (f"{type(module).__name__}: attention_mask has padding that masks keys per row (left or inner "
                 f"padding, or padding in a bidirectional model), which CP attention cannot combine with a logit "
                 f"softcap ({softcap}): build the batch with cpcompose.integrations.transformers.pack_batch")
    if isinstance(indices, Tensor):  # indexer-selected attention: only the selected rows move
        if error is None and (softcap is not None or sliding_window is not None):
            error = (f"{type(module).__name__}: indexer-selected attention with a softcap or a sliding window "
                     "is not supported under CP")
        if error is None and key_padding is not None:
            error = (f"{type(module).__name__}: indexer-selected attention with a per-row key mask (left padding, "
                     "or padding in a bidirectional model) is not supported under CP: build the batch with pack_batch")
        region.routed += 1
        sinks = kwargs.get("s_aux")
        out = attend_selected(query, key, value, indices, mesh=region.mesh, is_causal=causal, scale=scaling,
                              options=region.options, caller_error=error,
                              sinks=sinks if isinstance(sinks, Tensor) and not error else None)
        return out.transpose(1, 2).contiguous(), None
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks: one logit per head, joining every row's softmax
    positions = kwargs.get("position_ids") if compiling else None  # compiled: checked inside the op, at run time
    out = region.attend(query, key, value, is_causal=causal, scale=scaling, softcap=softcap, caller_error=error,
                        sinks=sinks if isinstance(sinks, Tensor) and not error else None,
                        window_size=None if error else window, key_padding=key_padding,
                        position_ids=positions if isinstance(positions, Tensor) else None)
    return out.transpose(1, 2).contiguous(), None


def _mask_refusal(attention_mask: object) -> str | None:
    if attention_mask is None or getattr(attention_mask, _NO_MASK_ATTR, False):
        return None
    if getattr(attention_mask, _KEY_PADDING_ATTR, None) is not None:
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
            "ranks; call the model with use_cache=False and no cache= (past_key_values=)"
        )
    if kwargs.get("position_bias") is not None:
        return "an additive position bias (position_bias=...) is not supported by CP attention"
    if kwargs.get("sinks") is not None:
        return "attention sinks per query (sinks=...) are not supported by CP attention (only gpt-oss's s_aux)"
    sinks = kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.shape != (query.shape[1],)):
        return f"attention sinks (s_aux) must be one logit per query head ({query.shape[1]}), got {sinks!r}"
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
    """Why the model's `position_ids` are not this rank's positions under the region's split, or None
    (`position_ids_error`). Not checked in a rehearsal (`comm.rehearsal_mode`): its fake tensors have no values
    to compare."""
    layout = region.layout()
    if rehearsing() or not isinstance(position_ids, Tensor) or layout is None:
        return None
    return position_ids_error(position_ids, layout, CPGroup.from_mesh(region.mesh).rank, query.shape[2])


def _selected_mask(attention_mask: Tensor | None, indices: Tensor, query: Tensor, key: Tensor, module: nn.Module,
                   is_causal: bool | None) -> Tensor:
    """transformers' mask (causal if none) narrowed to each query's selected keys, as its eager/sdpa paths do."""
    selected = torch.zeros(indices.shape[0], 1, query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
    selected.scatter_(-1, indices.long().unsqueeze(1), True)
    if attention_mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        ones = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
        attention_mask = ones.tril() if causal else ones
    if attention_mask.dtype != torch.bool:  # an additive float mask: 0 where a key is visible
        attention_mask = attention_mask == 0
    return attention_mask & selected


def _single_process(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
    dropout: float, scaling: float | None, softcap: float | None, is_causal: bool | None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """Outside a CP region: transformers' sdpa; an explicit softmax where logits are softcapped or masked.

    The explicit path fills masked scores with the dtype's minimum as transformers' eager
    does: SDPA's math kernel turns a fully masked row (a padding query under a sliding
    window) into NaN, which then reaches real tokens through the next layer's 0 * NaN. It
    adds a `position_bias` to the scores (sdpa folds it into its mask) and takes sinks as
    gpt-oss passes them (`s_aux`, one logit per head) or as Inkling 2 does (`sinks`, one
    per query: `(batch, heads, q, 1)`), both joining the softmax with no value.
    """
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if softcap is None and attention_mask is None and sinks is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = query @ key.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if kwargs.get("position_bias") is not None:  # an additive bias per query and key (Inkling's relative logits)
        scores = scores + kwargs["position_bias"]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None and causal and query.shape[2] > 1:
        attention_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:  # an additive float mask given by the caller
        scores = scores + attention_mask
    if sinks is not None:  # a logit with no value (per head, or per query): it joins the softmax and is dropped
        column = sinks.to(scores.dtype)
        column = (column.view(1, -1, 1, 1) if column.ndim == 1 else column).expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=dropout > 0)
    return (probs @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, cpcompose_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, cpcompose_mask)
