"""`nn.MultiheadAttention` under CP: its projections as written, its attention through CP.

`F.multi_head_attention_forward` (behind `nn.MultiheadAttention` and PyTorch's
`TransformerEncoderLayer` / `TransformerDecoderLayer`) calls SDPA from inside a
function that a TorchFunctionMode sees as one opaque call: left alone, its
attention would run on this rank's tokens only. Re-entering the mode from its
handler recurses (the function re-dispatches to any active mode), so the CP mode
computes the function itself: the same in-projection, head split and
out-projection, and the attention through the CP route. A `key_padding_mask` (this
rank's shard of it, cut like the keys: a `context_parallel` buffer) becomes CP
attention's per-row key mask, which travels with K/V. The features that cannot be
context-parallel (attention weights, explicit masks, bias_k, zero attention, static
K/V, dropout, a float key_padding_mask other than 0 / -inf) are refused through the
cross-rank agreement.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch.nn.functional as F
from torch import Tensor

from cpcompose.parallel.key_masks import real_keys

__all__ = ["Attend", "multi_head_attention_forward"]

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)

Attend = Callable[..., Tensor]
"""`attend(q, k, v, *, is_causal, caller_error, key_padding)` -> output `(B, H, L, D)`: the CP route."""


def multi_head_attention_forward(attend: Attend, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
    """`F.multi_head_attention_forward` with the attention computed by `attend` (see the module docstring)."""
    a = _SIGNATURE.bind(*args, **kwargs)
    a.apply_defaults()
    p = a.arguments
    query, key, value = p["query"], p["key"], p["value"]
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
    tgt_len, bsz, embed_dim = query.shape
    heads = p["num_heads"]
    head_dim = embed_dim // heads
    if p["use_separate_proj_weight"]:
        weights = (p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"])
    else:
        weights = p["in_proj_weight"].chunk(3)
    biases = (None,) * 3 if p["in_proj_bias"] is None else p["in_proj_bias"].chunk(3)
    q, k, v = (F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    # (L, N, E) -> (N, H, L, D): the layout SDPA and CP attention take.
    q, k, v = (t.reshape(t.shape[0], bsz, heads, head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
    key_padding, padding_error = _key_padding(p["key_padding_mask"], bsz)
    out = attend(q, k, v, is_causal=bool(p["is_causal"]), caller_error=_refusal(p) or padding_error,
                 key_padding=key_padding)
    out = out.permute(2, 0, 1, 3).reshape(tgt_len * bsz, embed_dim)
    out = F.linear(out, p["out_proj_weight"], p["out_proj_bias"]).view(tgt_len, bsz, embed_dim)
    return (out.squeeze(1) if unbatched else out), None


def _refusal(p: dict[str, Any]) -> str | None:
    """What this call asks of multi-head attention that CP cannot honour, or None."""
    where = "nn.MultiheadAttention under context parallelism"
    if p["need_weights"]:
        return f"{where} cannot return attention weights: call it with need_weights=False"
    for name in ("bias_k", "bias_v", "static_k", "static_v"):
        if p[name] is not None:
            return f"{where} does not support {name}; remove it (use a PackedLayout for document masks)"
    if p["add_zero_attn"]:
        return f"{where} does not support add_zero_attn=True"
    if p["training"] and p["dropout_p"]:
        return f"{where} does not support dropout (dropout={p['dropout_p']}); set it to 0"
    if p["attn_mask"] is not None and not p["is_causal"]:
        return (
            f"{where} cannot honour an explicit attn_mask (it indexes the global sequence); pass is_causal=True "
            "for a causal mask"
        )
    return None


def _key_padding(mask: object, bsz: int) -> tuple[Tensor | None, str | None]:
    """MHA's `key_padding_mask` (True or -inf = ignore; `(N, S)`, or `(S,)` unbatched) as CP's key mask, or why not."""
    if mask is None:
        return None, None
    where = "nn.MultiheadAttention under context parallelism takes a key_padding_mask"
    if not isinstance(mask, Tensor):
        return None, f"{where} as a tensor, got {type(mask).__name__}"
    mask = mask.reshape(1, -1) if mask.ndim == 1 else mask
    key_padding, error = real_keys(mask, bsz, true_means_real=False, what="key_padding_mask")
    return key_padding, None if error is None else f"{where}: {error}"
